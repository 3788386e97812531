"""The csrc paged decode-attention kernel against a float64 reference written from the layout.

Inputs are fresh random draws on every run (the seed is in every failure message). Outputs are
poisoned with NaN before each call, and cache slots the kernel must not read (unused blocks, slots
past a sequence's end or before its start) hold NaN too, so a stray read or a missed write shows.
"""

from __future__ import annotations

import math
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch

from bench.machine import cpu_variant
from common.attention.base import combine_partials
from common.attention.cpu_kernel import CpuKernelAttention, prefetch_target, supported_isas
from tests.kernel_gate import kernel_gate

pytestmark = kernel_gate("csrc kernel not built")

NUM_KV_HEADS = 2
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
ISAS = supported_isas()
BEST_ISA = ISAS[0] if ISAS else "generic"


@dataclass
class Case:
    """One random decode problem in the fixed KV layout."""

    q: torch.Tensor  # [num_seqs, num_q_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, num_kv_heads, head_dim, block_size]
    value_cache: torch.Tensor  # [num_blocks, num_kv_heads, block_size, head_dim]
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, shuffled over a larger pool
    context_lens: torch.Tensor  # [num_seqs] int32
    token_starts: torch.Tensor  # [num_seqs] int32
    seed: int

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.q.shape[-1])


def make_case(
    lengths: list[int],
    *,
    head_dim: int,
    group: int,
    block_size: int,
    dtype: torch.dtype,
    starts: list[int] | None = None,
    q_dtype: torch.dtype = torch.float32,
) -> Case:
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    starts = starts or [0] * len(lengths)
    blocks_per_seq = [math.ceil(n / block_size) for n in lengths]
    max_blocks = max(blocks_per_seq) + 2
    num_blocks = 2 * sum(blocks_per_seq) + 3  # half the pool stays unused (and NaN)
    pool = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_tables = torch.full((len(lengths), max_blocks), -1, dtype=torch.int32)
    kv_shape = (num_blocks, NUM_KV_HEADS, block_size, head_dim)  # V layout; K is transposed
    keys = torch.full(kv_shape, math.nan)
    values = torch.full(kv_shape, math.nan)
    used = 0
    for seq, (start, end) in enumerate(zip(starts, lengths, strict=True)):
        ids = pool[used : used + blocks_per_seq[seq]]
        used += blocks_per_seq[seq]
        block_tables[seq, : len(ids)] = ids
        tokens = torch.arange(start, end)
        blk, slot = ids[tokens // block_size].long(), tokens % block_size
        keys[blk, :, slot] = torch.randn(len(tokens), NUM_KV_HEADS, head_dim, generator=gen)
        values[blk, :, slot] = torch.randn(len(tokens), NUM_KV_HEADS, head_dim, generator=gen)
    q = torch.randn(len(lengths), NUM_KV_HEADS * group, head_dim, generator=gen)
    return Case(
        q=q.to(q_dtype),
        key_cache=keys.transpose(2, 3).contiguous().to(dtype),
        value_cache=values.to(dtype),
        block_tables=block_tables,
        context_lens=torch.tensor(lengths, dtype=torch.int32),
        token_starts=torch.tensor(starts, dtype=torch.int32),
        seed=seed,
    )


def reference(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention straight from the layout definition: token t is in slot t % block_size
    of block block_table[t // block_size]; K stored [head_dim][slot], V stored [slot][head_dim]."""
    num_seqs, num_q_heads, head_dim = case.q.shape
    block_size = case.key_cache.shape[-1]
    group = num_q_heads // NUM_KV_HEADS
    out = torch.zeros(num_seqs, num_q_heads, head_dim, dtype=torch.float64)
    lse = torch.full((num_seqs, num_q_heads), -math.inf, dtype=torch.float64)
    for seq in range(num_seqs):
        tokens = torch.arange(int(case.token_starts[seq]), int(case.context_lens[seq]))
        if len(tokens) == 0:
            continue
        blk = case.block_tables[seq, tokens // block_size].long()
        slot = tokens % block_size
        keys = case.key_cache[blk, :, :, slot].double()  # [T, Hkv, D]
        values = case.value_cache[blk, :, slot, :].double()  # [T, Hkv, D]
        q = case.q[seq].double().view(NUM_KV_HEADS, group, head_dim)
        scores = torch.einsum("hgd,thd->hgt", q, keys) * case.scale
        row_lse = torch.logsumexp(scores, dim=-1)  # [Hkv, G]
        probs = torch.exp(scores - row_lse.unsqueeze(-1))
        out[seq] = torch.einsum("hgt,thd->hgd", probs, values).reshape(num_q_heads, head_dim)
        lse[seq] = row_lse.reshape(num_q_heads)
    return out, lse


def run_kernel(
    backend: CpuKernelAttention, case: Case, **kwargs: object
) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.full(case.q.shape, math.nan)
    lse = torch.full(case.q.shape[:2], math.nan)
    return backend.decode(
        case.q,
        case.key_cache,
        case.value_cache,
        case.block_tables,
        case.context_lens,
        case.scale,
        case.token_starts,
        out=out,
        lse=lse,
        **kwargs,  # type: ignore[arg-type]
    )


def assert_close(case: Case, got: tuple[torch.Tensor, torch.Tensor], tol: float) -> None:
    want_out, want_lse = reference(case)
    out, lse = got
    assert not out.isnan().any() and not lse.isnan().any(), f"unwritten output (seed {case.seed})"
    out_err = (out.double() - want_out).abs().max() / want_out.abs().max().clamp(min=1e-6)
    assert out_err <= tol, f"out relative error {out_err:.3g} > {tol} (seed {case.seed})"
    finite = want_lse.isfinite()
    assert torch.equal(lse.isfinite(), finite), f"lse -inf mismatch (seed {case.seed})"
    lse_err = ((lse.double() - want_lse)[finite].abs() / want_lse[finite].abs().clamp(min=1)).max()
    assert lse_err <= tol, f"lse relative error {lse_err:.3g} > {tol} (seed {case.seed})"


def random_lengths(block_size: int, longest: int) -> list[int]:
    """Lengths 1..longest, including exact multiples of the block size and ragged ones."""
    whole_blocks = random.randrange(2, longest // block_size)
    ragged = whole_blocks * block_size + random.randrange(1, block_size)
    return [1, block_size, random.randrange(2, 300), ragged]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_matches_float64_reference(
    block_size: int, head_dim: int, group: int, dtype: torch.dtype
) -> None:
    case = make_case(
        random_lengths(block_size, 5000),
        head_dim=head_dim,
        group=group,
        block_size=block_size,
        dtype=dtype,
    )
    threads = 1 + (head_dim + group + block_size) % 3  # 1, 2 or 3 threads across the grid
    got = run_kernel(CpuKernelAttention(num_threads=threads), case)
    assert_close(case, got, TOLERANCE[dtype])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("head_dim", "group", "block_size"), [(64, 4, 16), (128, 8, 32)])
def test_every_isa_matches_reference(
    isa: str, dtype: torch.dtype, head_dim: int, group: int, block_size: int
) -> None:
    case = make_case(
        random_lengths(block_size, 1500),
        head_dim=head_dim,
        group=group,
        block_size=block_size,
        dtype=dtype,
    )
    got = run_kernel(CpuKernelAttention(num_threads=2, isa=isa), case)
    assert_close(case, got, TOLERANCE[dtype])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("group", [1, 4])
def test_bfloat16_head_dim_of_an_odd_vector_count(isa: str, group: int) -> None:
    """bfloat16 V is widened two vectors a load into accumulators that hold each pair's even and
    odd elements apart, put back in order at the end (csrc/fragment_kernel.h, load_pair); with
    48 = 3 x 16 floats the last vector of a row takes the one-vector path (AVX-512): both parts
    land where the float64 reference has them."""
    case = make_case(
        random_lengths(16, 600), head_dim=48, group=group, block_size=16, dtype=torch.bfloat16
    )
    got = run_kernel(CpuKernelAttention(num_threads=2, isa=isa), case)
    assert_close(case, got, TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize(
    ("group", "dtype"),
    [(2, torch.float32), (3, torch.bfloat16), (5, torch.float32), (6, torch.float32),
     (6, torch.bfloat16)],
    ids=["g2-f32", "g3-bf16", "g5-f32", "g6-f32", "g6-bf16"],
)  # fmt: skip
def test_group_sizes_off_the_row_tiles(group: int, dtype: torch.dtype) -> None:
    """Groups the kernel scores and accumulates V in row tiles of 4, 2 and 1 (4 + 2, 4 + 1,
    2 + 1, one tile of 2) and with 8 or 4 K tiles side by side: every remainder path meets the
    float64 reference."""
    case = make_case(random_lengths(16, 1200), head_dim=64, group=group, block_size=16, dtype=dtype)
    got = run_kernel(CpuKernelAttention(num_threads=2), case)
    assert_close(case, got, TOLERANCE[dtype])


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_one_long_sequence_split_across_threads(threads: int) -> None:
    case = make_case(
        [random.randrange(4000, 5001)], head_dim=128, group=4, block_size=16, dtype=torch.float32
    )
    assert_close(case, run_kernel(CpuKernelAttention(num_threads=threads), case), 1e-5)


def test_bfloat16_queries() -> None:
    case = make_case(
        [37, 700], head_dim=64, group=4, block_size=16, dtype=torch.bfloat16, q_dtype=torch.bfloat16
    )
    assert_close(case, run_kernel(CpuKernelAttention(num_threads=2), case), 1e-2)


def test_token_starts_and_empty_ranges() -> None:
    lengths, starts = [0, 50, 50, 1000, 333], [0, 50, 49, 17, 300]
    case = make_case(
        lengths, starts=starts, head_dim=64, group=4, block_size=16, dtype=torch.float32
    )
    out, lse = run_kernel(CpuKernelAttention(num_threads=2), case)
    assert_close(case, (out, lse), 1e-5)
    assert torch.equal(out[:2], torch.zeros_like(out[:2])) and (lse[:2] == -math.inf).all()


def test_token_range_partials_combine_to_full() -> None:
    lengths = [1, 16, 500, 4001, 77]
    case = make_case(lengths, head_dim=128, group=8, block_size=32, dtype=torch.float32)
    backend = CpuKernelAttention(num_threads=2)
    splits = torch.tensor([0, 16, random.randrange(1, 500), random.randrange(1, 4001), 40])
    first = Case(**{**vars(case), "context_lens": splits.to(torch.int32)})
    second = Case(**{**vars(case), "token_starts": splits.to(torch.int32)})
    out, lse = combine_partials(*run_kernel(backend, first), *run_kernel(backend, second))
    assert_close(case, (out, lse), 1e-5)


def test_head_ranges_fill_one_output() -> None:
    case = make_case([900, 5, 64], head_dim=64, group=4, block_size=16, dtype=torch.bfloat16)
    backend = CpuKernelAttention(num_threads=2)
    out = torch.full(case.q.shape, math.nan)
    lse = torch.full(case.q.shape[:2], math.nan)
    args = (case.q, case.key_cache, case.value_cache, case.block_tables, case.context_lens)
    backend.decode(*args, case.scale, out=out, lse=lse, kv_head_start=1, kv_head_end=2)
    assert out[:, :4].isnan().all() and lse[:, :4].isnan().all(), "wrote rows of another head"
    backend.decode(*args, case.scale, out=out, lse=lse, kv_head_start=0, kv_head_end=1)
    assert_close(case, (out, lse), 1e-2)
    full_out, full_lse = run_kernel(backend, case)
    assert torch.allclose(out, full_out, rtol=1e-6, atol=1e-6)
    assert torch.allclose(lse, full_lse, rtol=1e-6, atol=1e-6)


def test_rejects_block_ids_outside_the_cache() -> None:
    case = make_case([40], head_dim=64, group=1, block_size=16, dtype=torch.float32)
    case.block_tables[0, 1] = case.key_cache.shape[0]
    with pytest.raises(ValueError, match="outside the cache"):
        run_kernel(CpuKernelAttention(), case)


def test_rejects_mismatched_shapes_and_isas() -> None:
    case = make_case([40], head_dim=64, group=1, block_size=16, dtype=torch.float32)
    case.value_cache = case.value_cache[:, :, :, :32].contiguous()
    with pytest.raises(ValueError, match="value_cache has shape"):
        run_kernel(CpuKernelAttention(), case)
    with pytest.raises(ValueError, match="isa must be one of"):
        CpuKernelAttention(isa="sse9")


def test_concurrent_calls_share_one_backend() -> None:
    case = make_case([300, 1200], head_dim=64, group=4, block_size=16, dtype=torch.float32)
    backend = CpuKernelAttention(num_threads=2)
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda _: run_kernel(backend, case), range(8)))
    for got in results:
        assert_close(case, got, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_many_short_fragments_one_range_with_empty_ones_between(dtype: torch.dtype) -> None:
    """At 1 thread one range runs every fragment in turn, each one's last step prefetching the
    next one's first tiles (`FragmentArgs.next_*`), past empty segments (no tokens: a zero
    length, or a start at the end) and ragged last blocks: every row meets the reference."""
    lengths = [33, 0, 16, 1, 90, 40, 0, 130, 17, 64]
    starts = [0, 0, 0, 0, 0, 40, 0, 3, 0, 0]  # the sixth has its start at its end: no tokens
    case = make_case(lengths, starts=starts, head_dim=64, group=4, block_size=16, dtype=dtype)
    out, lse = run_kernel(CpuKernelAttention(num_threads=1), case)
    assert_close(case, (out, lse), TOLERANCE[dtype])
    for empty in (1, 5, 6):
        assert torch.equal(out[empty], torch.zeros_like(out[empty]))
        assert (lse[empty] == -math.inf).all()


def test_prefetch_target_follows_the_cpu_family() -> None:
    """Decode attention prefetches into L2 on AMD family 19h cores (Zen 3 and 4), where it read
    faster that way on every shape, and into L1 on every other CPU (csrc/isa_select.cpp)."""
    cpu = cpu_variant()
    if cpu["family"] is None:
        pytest.skip("no CPU family in /proc/cpuinfo")
    amd_19h = (cpu["vendor"], cpu["family"]) == ("AuthenticAMD", 0x19)
    assert prefetch_target() == ("l2" if amd_19h else "l1")
