"""A pipe that wakes a poll loop from other threads: the loop registers `fileno` with its poller
(zmq.Poller, select, epoll), other threads call `wake`, and the loop calls `clear` before it
takes what woke it.

Both ends are non-blocking: a full pipe is readable already (the loop is due to wake), so a
`wake` never blocks. `close` is safe against a `wake` on another thread at the same time: after
it, `wake` does nothing (a closed descriptor number may be another file's by then).
"""

from __future__ import annotations

import os
import threading


class WakePipe:
    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._lock = threading.Lock()

    def fileno(self) -> int:
        """Readable once `wake` was called since the last `clear`."""
        return self._read_fd

    def wake(self) -> None:
        with self._lock:
            if self._write_fd < 0:
                return  # closed: nobody is left to wake
            try:
                os.write(self._write_fd, b"\0")
            except BlockingIOError:  # full: readable already
                pass

    def clear(self) -> None:
        """Take every wake-up so far (the loop then handles all that woke it)."""
        try:
            while os.read(self._read_fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        with self._lock:
            if self._write_fd < 0:
                return
            os.close(self._read_fd)
            os.close(self._write_fd)
            self._write_fd = -1
