"""Property: whatever request body the API's pydantic models accept maps to engine parameters that
pass the engine's own checks, cross the wire intact (msgpack, as `GenerateRequest`) and sample
without raising; whatever they cannot map is a 400 naming a parameter, never another error.

Bodies are drawn from edge values on purpose: huge and negative integers, NaN, infinities,
subnormals, empty and oversized lists, wrong types."""

from __future__ import annotations

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from common.protocol import EngineCommand, GenerateRequest
from common.sampling import Sampler
from common.sampling_params import SamplingParams
from services.router.api_errors import APIError
from services.router.openai_api import ChatCompletionRequest, CompletionRequest

edge_ints = st.one_of(
    st.integers(-3, 40), st.sampled_from([2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63)])
)
edge_floats = st.one_of(
    st.floats(-3, 3), st.sampled_from([0.0, 5e-324, 1e-310, 1e-5, 2.0, float("inf"), float("nan")])
)
anything = st.one_of(st.none(), st.booleans(), edge_ints, edge_floats, st.text(max_size=3))
stops = st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=20))


def mostly(usual: st.SearchStrategy, rare: st.SearchStrategy) -> st.SearchStrategy:
    """`usual` seven times in eight (`one_of` would weigh the two alike)."""
    return st.integers(0, 7).flatmap(lambda i: rare if i == 0 else usual)


def usual_or_edge(usual: st.SearchStrategy, edge: st.SearchStrategy) -> st.SearchStrategy:
    return mostly(usual, edge)


FIELDS = {
    "max_tokens": usual_or_edge(st.integers(1, 64), edge_ints),
    "temperature": usual_or_edge(st.floats(0, 2), edge_floats),
    "top_p": usual_or_edge(st.floats(1e-9, 1), edge_floats),
    "top_k": usual_or_edge(st.integers(-1, 100), edge_ints),
    "seed": usual_or_edge(st.integers(0, 2**63 - 1), edge_ints),
    "min_tokens": usual_or_edge(st.integers(0, 4), edge_ints),
    "stop": stops,
    "stop_token_ids": st.lists(usual_or_edge(st.integers(0, 2**31 - 1), edge_ints), max_size=4),
    "ignore_eos": st.booleans(),
    "presence_penalty": usual_or_edge(st.just(0.0), edge_floats),
    "frequency_penalty": usual_or_edge(st.just(0.0), edge_floats),
    "n": usual_or_edge(st.just(1), edge_ints),
}
bodies = st.fixed_dictionaries(
    # Mostly the field's own kind of value (edge values included), sometimes anything at all.
    {}, optional={name: mostly(strategy, anything)
                  for name, strategy in FIELDS.items()},
)  # fmt: skip


def _check_maps_to_engine(request: CompletionRequest | ChatCompletionRequest) -> None:
    try:
        request.reject_unsupported()  # n, penalties, ...: the router's 400s
        params = request.sampling_params(max_tokens=request.max_tokens or 16)
    except APIError as exc:
        assert exc.status == 400 and exc.param, exc.message
        event("refused by the router (400)")
        return
    event("reaches the engine")
    spec = params.to_spec()
    message = GenerateRequest("r", [1, 2, 3], spec, "tcp://router", "tcp://t", "tcp://t-kv")
    arrived = msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=EngineCommand)
    assert isinstance(arrived, GenerateRequest) and arrived.sampling == spec
    engine_params = SamplingParams.from_spec(arrived.sampling)  # the engine's own checks
    logits = torch.randn(2, 64) * 30
    histories = [([1, 2, 3], []), ([1, 2, 3], [7, 7, 9, 1, 2])]
    out = Sampler().sample(logits, [engine_params, engine_params], [0, 5], histories)
    tokens, failures = out.token_ids, out.failures
    assert not failures and all(0 <= t < 64 for t in tokens)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies)
def test_any_accepted_completion_body_reaches_the_engine(body: dict) -> None:
    try:
        request = CompletionRequest.model_validate({"prompt": [1, 2, 3], **body})
    except ValidationError:
        event("refused by the schema (400)")
        return
    _check_maps_to_engine(request)


@settings(max_examples=200, deadline=None)
@given(body=bodies)
def test_any_accepted_chat_body_reaches_the_engine(body: dict) -> None:
    try:
        request = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi"}], **body}
        )
    except ValidationError:
        return
    _check_maps_to_engine(request)


@pytest.mark.parametrize("temperature", [5e-324, 1e-310, 1e-5, 2.0])
def test_edge_temperatures_sample(temperature: float) -> None:
    params = SamplingParams(temperature=temperature, seed=1)
    out = Sampler().sample(torch.randn(1, 64) * 50, [params], [0])
    tokens, failures = out.token_ids, out.failures
    assert not failures and 0 <= tokens[0] < 64
