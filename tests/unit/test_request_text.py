"""Streamed text: incremental detokenization gives exactly the full decode, stop strings cut it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.engine.request import Request
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return Tokenizer(tiny_model_path)


def stream(tokenizer: Tokenizer, token_ids: list[int], **params) -> tuple[str, Request]:
    request = Request("r", [1], SamplingParams(max_tokens=len(token_ids), **params))
    deltas = []
    for t in token_ids:
        deltas.append(request.append(t, tokenizer).new_text)
        if request.finish_reason:
            break
    return "".join(deltas), request


@settings(max_examples=100, deadline=None)
@given(st.text(min_size=1, max_size=60))
def test_streamed_deltas_join_to_the_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    streamed, request = stream(tokenizer, ids)
    assert streamed == tokenizer.decode(ids) == request.text


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=2047), min_size=1, max_size=40))
def test_any_token_ids_stream_to_the_full_decode(tokenizer, ids):
    # Random ids split multi-byte characters anywhere: held back until complete or finished.
    streamed, _ = stream(tokenizer, ids)
    assert streamed == tokenizer.decode(ids)


def test_stop_string_cuts_the_text_and_finishes(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta", add_special_tokens=False)
    streamed, request = stream(tokenizer, ids, stop=["gam"])
    assert streamed == "alpha beta " and request.finish_reason == "stop"
