"""`freeze_startup_heap`: dead cycles are collected first; live objects leave later scans."""

from __future__ import annotations

import gc
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
    frozen = freeze_startup_heap()
    assert frozen == gc.get_freeze_count() > 0
    # NOTE: `gc.get_objects()` lists only what collections can see: frozen objects are not in it.
    assert all(obj is not survivor for obj in gc.get_objects())
    gc.unfreeze()
    assert any(obj is survivor for obj in gc.get_objects())
