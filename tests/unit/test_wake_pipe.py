"""common/wake_pipe.py: a wake from another thread makes the loop's descriptor readable, `clear`
takes every wake so far, a full pipe never blocks a waker, and a wake after `close` (a thread
racing a shutdown) does nothing rather than write to a descriptor that may be another file's."""

from __future__ import annotations

import os
import select
import threading

from common.wake_pipe import WakePipe


def readable(pipe: WakePipe, timeout: float = 0.0) -> bool:
    return bool(select.select([pipe.fileno()], [], [], timeout)[0])


def test_a_wake_from_another_thread_is_readable_until_cleared() -> None:
    pipe = WakePipe()
    assert not readable(pipe)
    threading.Thread(target=pipe.wake).start()
    assert readable(pipe, timeout=30.0)  # a hang guard, not a speed bound
    pipe.clear()
    assert not readable(pipe)
    pipe.close()


def test_a_full_pipe_does_not_block_a_waker_and_clear_empties_it() -> None:
    pipe = WakePipe()
    for _ in range(100_000):  # more than any pipe buffer holds
        pipe.wake()
    assert readable(pipe)
    pipe.clear()
    assert not readable(pipe)
    pipe.close()


def test_a_wake_after_close_writes_nothing_even_to_a_reused_descriptor() -> None:
    pipe = WakePipe()
    pipe.close()
    pipe.close()  # twice: a no-op
    read_fd, write_fd = os.pipe()  # may take the closed pipe's numbers
    try:
        pipe.wake()
        os.set_blocking(read_fd, False)
        try:
            leaked = os.read(read_fd, 16)
        except BlockingIOError:
            leaked = b""
        assert leaked == b""
    finally:
        os.close(read_fd)
        os.close(write_fd)
