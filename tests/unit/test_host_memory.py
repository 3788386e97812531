"""Host tensors on transparent huge pages (common/host_memory.py), as the KV pool allocates them:
zeroed, contiguous, aligned to a huge page, alive as long as any view of them, backed by huge
pages where the kernel grants them, and the same tensors (4 KiB pages) where it does not."""

from __future__ import annotations

import gc

import pytest
import torch

from common import host_memory
from common.host_memory import (
    HUGE_PAGE,
    huge_page_bytes,
    huge_page_copy,
    huge_page_zeros,
    huge_pages_available,
)
from common.kv_cache import KVCache

_THP_SETTING = host_memory._THP_ENABLED.read_text() if host_memory._THP_ENABLED.exists() else ""
needs_thp = pytest.mark.skipif(
    not huge_pages_available(), reason="this kernel has transparent huge pages off"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_a_tensor_is_zeroed_contiguous_and_starts_on_a_huge_page(dtype):
    shape = (3, 1000, 700)  # 2.1 M elements: a partial huge page at the end
    t = huge_page_zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    assert int(t.count_nonzero()) == 0
    t[-1, -1, -1] = 1  # the last element is writable: the mapping covers it
    assert int(t.count_nonzero()) == 1


def test_the_memory_lives_as_long_as_a_view_of_it():
    t = huge_page_zeros((HUGE_PAGE // 4,), torch.float32)
    view = t[10:20]
    del t
    gc.collect()
    view.fill_(2.0)
    assert float(view.sum()) == 20.0


def test_an_empty_shape_is_an_empty_tensor():
    assert huge_page_zeros((0, 16), torch.float32).shape == (0, 16)


def test_a_negative_dimension_is_refused_as_torch_refuses_it():
    with pytest.raises(ValueError, match="negative dimension"):
        huge_page_zeros((-1, 16), torch.float32)


def test_a_copy_holds_the_values_contiguous_and_aligned():
    source = torch.arange(3 * HUGE_PAGE // 4, dtype=torch.float32).view(-1, 3).t()  # strided
    copy = huge_page_copy(source)
    assert copy.is_contiguous() and copy.data_ptr() % HUGE_PAGE == 0
    assert torch.equal(copy, source)


@needs_thp
def test_a_pool_of_several_huge_pages_is_backed_by_them():
    t = huge_page_zeros((4 * HUGE_PAGE // 2,), torch.bfloat16)
    assert huge_page_bytes(t) >= 2 * HUGE_PAGE  # the kernel may miss a page or two, not all


@needs_thp
def test_the_cpu_kv_pool_is_on_huge_pages():
    kv = KVCache(2, 512, 16, 2, 128, torch.bfloat16)  # 4 MiB of K, 4 of V
    assert kv.key.data_ptr() % HUGE_PAGE == 0 and kv.value.data_ptr() % HUGE_PAGE == 0
    assert huge_page_bytes(kv.key) > 0 and huge_page_bytes(kv.value) > 0
    assert int(kv.key.count_nonzero()) == 0


def test_without_huge_pages_the_same_tensor_comes_on_small_pages(monkeypatch):
    """THP off (`never`): no advice is given, and the tensor is the same, zeroed and aligned."""
    monkeypatch.setattr(host_memory, "huge_pages_available", lambda: False)
    t = huge_page_zeros((HUGE_PAGE // 4,), torch.float32)
    assert t.data_ptr() % HUGE_PAGE == 0 and int(t.count_nonzero()) == 0
    if "[madvise]" in _THP_SETTING:  # (`always` would back it unadvised)
        assert huge_page_bytes(t) == 0
