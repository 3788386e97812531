"""`common.request_ids`: ids as `uuid4().hex` gives them, never repeated, not shared with a forked
child, and not a function of the counter alone (another process's key gives other ids)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from common.request_ids import random_hex


def test_ids_are_hex_of_the_asked_length_and_never_repeat() -> None:
    ids = [random_hex() for _ in range(100_000)]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids[:1000])
    assert re.fullmatch(r"[0-9a-f]{8}", random_hex(8))


@pytest.mark.parametrize("chars", [0, 33, -1])
def test_a_length_outside_1_to_32_is_refused(chars: int) -> None:
    with pytest.raises(ValueError, match="chars must be 1 to 32"):
        random_hex(chars)


def test_a_forked_child_makes_ids_its_parent_does_not() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        os.close(read)
        os.write(write, " ".join(random_hex() for _ in range(100)).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        child = set(pipe.read().split())
    os.waitpid(pid, 0)
    parent = {random_hex() for _ in range(100)}
    assert len(child) == 100 and not child & parent


def test_two_processes_make_different_ids() -> None:
    """The same counters under another key: a process's ids say nothing of another's."""
    code = "from common.request_ids import random_hex; print(random_hex())"
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout.strip() for _ in range(2)}  # fmt: skip
    assert len(runs) == 2
