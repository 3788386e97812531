"""`ShardLinker`: a token engine's new shard links, connected off its loop.

A UCX connect waits for the shard's acknowledgement, up to `shard_link_timeout_s`: a shard that is
stopped, slow to start or on a congested host would hold the decode loop, and every batch-mate
with it, for that long. The engine's worker names the shards it wants (`want`); one thread per
address connects (trying again, with backoff, while the address is still wanted and does not
answer), and each link made is handed to the loop through a queue and a pipe the loop polls
(`fileno`, `ready`). The loop swaps a group in between steps once all of its links are at hand;
until then it decodes against the links it has (or locally).

Faults: a shard that never answers is retried every `retry_max_s` at most, on its own thread,
until the worker stops wanting it (its group changed: the keeper found it gone); a connect
that raises anything else is logged and retried the same way; a link made for an address no
longer wanted is closed on the loop, never used. `close` stops every thread (each within one
connect timeout; they are daemons, so a process that exits does not wait for them).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable

import structlog

from common.protocol import ShardAddress
from common.wake_pipe import WakePipe
from services.engine.shard_round_trip import ShardLink

log = structlog.get_logger(__name__)

RETRY_S = 0.5  # the first retry of a shard that did not answer; doubled each time
RETRY_MAX_S = 8.0


class ShardLinker:
    """Connects wanted shard links on background threads; see the module docstring.
    `connect(shard)` makes one link or raises (ChannelClosed after its own timeout)."""

    def __init__(
        self,
        connect: Callable[[ShardAddress], ShardLink],
        retry_s: float = RETRY_S,
        retry_max_s: float = RETRY_MAX_S,
    ) -> None:
        self._connect = connect
        self._retry_s, self._retry_max_s = retry_s, retry_max_s
        self._lock = threading.Lock()
        self._wanted: dict[str, threading.Event] = {}  # address -> set when no longer wanted
        self._made: queue.SimpleQueue[tuple[str, ShardLink]] = queue.SimpleQueue()
        self._closed = False
        self._wake = WakePipe()

    def fileno(self) -> int:
        """Readable when a link was made (register with the loop's poller)."""
        return self._wake.fileno()

    def connecting(self) -> set[str]:
        with self._lock:
            return set(self._wanted)

    def want(self, shards: Iterable[ShardAddress]) -> None:
        """Connect exactly these shards (those already connecting go on); any other address
        being connected is given up."""
        wanted = {s.link_address: s for s in shards}
        with self._lock:
            for address in [a for a in self._wanted if a not in wanted]:
                self._wanted.pop(address).set()
            for address, shard in wanted.items():
                if address in self._wanted:
                    continue
                stop = self._wanted[address] = threading.Event()
                threading.Thread(
                    target=self._link, args=(shard, stop), name="shard-link", daemon=True
                ).start()

    def ready(self) -> list[tuple[str, ShardLink]]:
        """Links made since the last call, by address, for addresses still wanted; the rest
        are closed here (on the caller's thread, the one that would have used them)."""
        self._wake.clear()
        made: list[tuple[str, ShardLink]] = []
        while True:
            try:
                address, link = self._made.get_nowait()
            except queue.Empty:
                return made
            with self._lock:
                stop = self._wanted.pop(address, None)
            if stop is not None:
                stop.set()  # a thread started again for it meanwhile stops too
                made.append((address, link))
            else:
                link.close()

    def close(self) -> None:
        """Stop connecting; links made and not yet taken are closed."""
        self.want(())
        self.ready()
        with self._lock:
            self._closed = True
        self._wake.close()

    def _link(self, shard: ShardAddress, stop: threading.Event) -> None:
        """One address, until a link is made or it is no longer wanted."""
        wait_s = self._retry_s
        while not stop.is_set():
            try:
                link = self._connect(shard)
            except Exception as exc:  # noqa: BLE001 - gone, stopped, or not ready yet: try again
                log.warning("shard did not answer a new link; trying again",
                            shard=shard.service_id, retry_in_s=wait_s, error=repr(exc))  # fmt: skip
                stop.wait(wait_s)
                wait_s = min(2 * wait_s, self._retry_max_s)
                continue
            self._made.put((shard.link_address, link))
            with self._lock:
                if self._closed:  # the worker is gone: nobody will take it
                    link.close()
                    return
                self._wake.wake()
            return


__all__ = ["ShardLinker"]
