"""Random ids for requests and responses, made without a system call each.

`uuid.uuid4()` reads 16 bytes from the kernel (`getrandom`) for every id, and CPython releases
the GIL around that call: on a Router whose engine shares the process (`topology: local`), the
engine's thread can take the GIL there, and the event loop waits for it back before it answers
the next request (a sampled profile of the loop under many short requests put a sixth of its time
on that line). These ids are a keyed BLAKE2b of a per-process counter: unique (distinct counters,
a 128-bit digest), unguessable without the key (from the kernel once per process, and again in a
forked child, so that parent and child never share ids), and pure CPU.
"""

from __future__ import annotations

import hashlib
import itertools
import os

_state: tuple[bytes, itertools.count[int]]  # the key and the counter, set by _reseed


def _reseed() -> None:
    global _state
    _state = (os.urandom(32), itertools.count())


_reseed()
os.register_at_fork(after_in_child=_reseed)


def random_hex(chars: int = 32) -> str:
    """`chars` (at most 32) random lowercase hex digits, as `uuid.uuid4().hex[:chars]` gives."""
    if not 0 < chars <= 32:
        raise ValueError(f"chars must be 1 to 32, not {chars}")
    key, counter = _state
    digest = hashlib.blake2b(next(counter).to_bytes(8, "little"), key=key, digest_size=16)
    return digest.hexdigest()[:chars]
