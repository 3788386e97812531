"""A step's inputs built without copies: `Request.token_ids` reads as `all_token_ids` does, and
`int_tensor` gives what `torch.tensor` gives, so the prepared steps are the same."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.engine.request import Request
from common.engine.runner import int_tensor, pad_block_tables
from common.sampling_params import SamplingParams

ids = st.lists(st.integers(min_value=0, max_value=50_000), max_size=12)


@settings(max_examples=200, deadline=None)
@given(ids, ids, st.integers(-30, 30), st.integers(-30, 30), st.sampled_from([1, 2, -1]))
def test_token_ids_reads_as_all_token_ids(prompt, output, a, b, step):
    request = Request("r", prompt, SamplingParams(), output_token_ids=output)
    whole, view = request.all_token_ids, request.token_ids
    assert len(view) == len(whole) and list(view) == whole
    assert view[a:b:step] == whole[a:b:step] and view[a:] == whole[a:] and view[:b] == whole[:b]
    for i in (a, b):
        if -len(whole) <= i < len(whole):
            assert view[i] == whole[i]
        else:
            with pytest.raises(IndexError):
                view[i]


def test_token_ids_is_a_view_of_the_lists_as_they_grow():
    request = Request("r", [5, 6], SamplingParams(max_tokens=4))
    view = request.token_ids
    request.append(7, None)
    assert view[-1] == 7 and view[2:] == [7] and len(view) == 3


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("values", [[], [3], [0, -1, 2**31 - 1, 17]])
def test_int_tensor_equals_torch_tensor(values, dtype):
    got, want = int_tensor(values, dtype), torch.tensor(values, dtype=dtype)
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    got += 1  # its own writable memory
    assert torch.equal(got, want + 1)


def test_int_tensor_out_of_range_raises():
    with pytest.raises(OverflowError):
        int_tensor([2**31], torch.int32)
    with pytest.raises(OverflowError):
        int_tensor([2**63])


def test_pad_block_tables_pads_with_block_zero():
    got = pad_block_tables([[4, 5, 6], [7], []])
    assert got.dtype == torch.int32
    assert got.tolist() == [[4, 5, 6], [7, 0, 0], [0, 0, 0]]
    assert pad_block_tables([]).shape == (0, 1)
