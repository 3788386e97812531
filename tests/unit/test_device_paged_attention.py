"""The device engines' paged decode attention (`DevicePagedAttention`), run on the CPU against the
float64 reference written from the KV layout (test_paged_attention_kernel.py's cases: shuffled
block pools, NaN in every slot it must not read, token ranges that start late or are empty)."""

from __future__ import annotations

import pytest
import torch

from common.attention import DevicePagedAttention, select_backend
from tests.unit.test_paged_attention_kernel import assert_close, make_case

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("block_size", "group"), [(16, 1), (16, 4), (8, 3)])
def test_matches_float64_reference(dtype: torch.dtype, block_size: int, group: int) -> None:
    case = make_case([1, 17, 64, 130, 5], head_dim=64, group=group, block_size=block_size,
                     dtype=dtype, q_dtype=dtype)  # fmt: skip
    # Padding entries of the block tables (-1) gather the pool's last block: they must be masked.
    got = DevicePagedAttention().decode(
        case.q, case.key_cache, case.value_cache, case.block_tables, case.context_lens, case.scale
    )
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    assert_close(case, got, TOLERANCE[dtype])


def test_token_ranges_and_empty_rows() -> None:
    """Ranges [start, end) (Neo's split halves) and an empty range: out 0, lse -inf."""
    case = make_case([40, 33, 16, 9], starts=[16, 0, 16, 3], head_dim=32, group=2,
                     block_size=16, dtype=torch.float32)  # fmt: skip
    out, lse = DevicePagedAttention().decode(
        case.q, case.key_cache, case.value_cache, case.block_tables, case.context_lens,
        case.scale, case.token_starts,
    )  # fmt: skip
    assert_close(case, (out, lse), TOLERANCE[torch.float32])
    assert torch.all(out[2] == 0) and torch.all(lse[2] == float("-inf"))  # 16..16: empty


def test_selection_by_device() -> None:
    """auto on a CUDA device is this backend, and no CPU-only backend is taken there; on the CPU
    it is asked by name (the CPU's auto stays the C++ kernel or the torch reference)."""
    cuda = torch.device("cuda")
    assert isinstance(select_backend("auto", cuda), DevicePagedAttention)
    assert isinstance(select_backend("device_paged"), DevicePagedAttention)
    assert not isinstance(select_backend("auto", torch.device("cpu")), DevicePagedAttention)
    with pytest.raises(ValueError, match="runs on the CPU"):
        select_backend("cpu_kernel", cuda)
