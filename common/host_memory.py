"""Host tensors on transparent huge pages: the memory the kernels stream through at random.

Why: the decode-attention kernel (csrc/) walks the paged KV cache in block-table order, and the
blocks lie anywhere in the pool. A bfloat16 tile of 16 tokens by 128 dims is 4 KiB, one page:
on 4 KiB pages nearly every tile the kernel reads is a TLB miss and a page walk, on top of the
line fills. Backed by 2 MiB pages, a pool of a few GiB is a few thousand TLB entries' worth, and
the walks mostly vanish (`bench/attention.py` allocates its KV sets here, as the engine does;
docs/benchmarks/kernels.md has the paired runs).

How: an anonymous private mapping, advised `MADV_HUGEPAGE` (the setting most distributions ship,
`/sys/kernel/mm/transparent_hugepage/enabled` = `madvise`, backs only advised ranges), its start
rounded up to 2 MiB (only whole aligned 2 MiB ranges take a huge page), and touched at once, a
byte a page (the kernel hands anonymous pages over zeroed): a first touch mid-decode would stall
that step. Faster to make than `torch.zeros` of the same size, which faults 4 KiB at a time.
The tensor keeps the mapping alive (`torch.frombuffer` holds it); the mapping goes when the last
view of it does.

Faults: where huge pages are off (`never`), unsupported, or none is free at the first touch, the
kernel backs the same range with 4 KiB pages: the tensor is the same, only slower to walk.
`huge_page_bytes` tells which (the bench reports it). A mapping that cannot be made raises
MemoryError, as torch's allocator would.
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """True when this kernel backs advised anonymous memory with transparent huge pages."""
    try:
        setting = _THP_ENABLED.read_text()
    except OSError:
        return False
    return "[never]" not in setting and hasattr(mmap, "MADV_HUGEPAGE")


def huge_page_zeros(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed, contiguous CPU tensor whose pages are all touched, on 2 MiB pages where the
    kernel has them (see the module docstring)."""
    if any(size < 0 for size in shape):
        raise ValueError(f"negative dimension in shape {tuple(shape)}")
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE  # whole huge pages, the last one too
    try:
        mapping = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:
        raise MemoryError(f"cannot map {span + HUGE_PAGE} bytes: {e}") from e
    if huge_pages_available():
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # an older kernel without THP: 4 KiB pages, nothing else changes
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds `mapping` for the tensor's life
    start = -raw.data_ptr() % HUGE_PAGE
    # The first touch, now: a byte a page faults each range in (a huge page per aligned 2 MiB
    # where granted), and the kernel hands anonymous memory over zeroed.
    raw[start : start + span : mmap.PAGESIZE].zero_()
    return raw[start : start + nbytes].view(dtype).view(shape)


def huge_page_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor, on huge pages as `huge_page_zeros` makes them."""
    return huge_page_zeros(tensor.shape, tensor.dtype).copy_(tensor)


def huge_page_bytes(tensor: torch.Tensor) -> int:
    """Bytes of huge pages backing the mapping that holds `tensor`'s first element, as
    /proc/self/smaps reports them (0 on 4 KiB pages, or where smaps cannot be read)."""
    address = tensor.data_ptr()
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    inside = False
    for line in lines:
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end perms ...
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0


__all__ = [
    "HUGE_PAGE",
    "huge_page_bytes",
    "huge_page_copy",
    "huge_page_zeros",
    "huge_pages_available",
]
