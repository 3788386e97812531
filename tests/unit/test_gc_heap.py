"""`freeze_startup_heap`: dead cycles are collected first; live objects leave later scans."""

from __future__ import annotations

import gc
import sys
import weakref
from collections.abc import Iterator

import pytest

from common.gc_heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


@pytest.fixture
def unfreeze_after() -> Iterator[None]:
    yield
    gc.unfreeze()  # the test process's heap goes back to normal collections


def test_cycles_dead_at_the_call_are_collected_not_frozen(unfreeze_after: None) -> None:
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # a reference cycle: only the collector frees it
    dead = weakref.ref(a)
    del a, b
    freeze_startup_heap()
    assert dead() is None


def test_live_objects_are_frozen_out_of_full_collections(unfreeze_after: None) -> None:
    survivor = _Node()
    # NOTE: a frozen object another thread of this process frees (reference counting still
    # frees them) leaves the count: no thread switch between the two reads, so both see one heap.
    switch_s = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    try:
        frozen = freeze_startup_heap()
        count = gc.get_freeze_count()
    finally:
        sys.setswitchinterval(switch_s)
    assert frozen == count > 0
    # NOTE: `gc.get_objects()` lists only what collections can see: frozen objects are not in it.
    assert all(obj is not survivor for obj in gc.get_objects())
    gc.unfreeze()
    assert any(obj is survivor for obj in gc.get_objects())
