"""Structured outputs through `LLMEngine`: every output parses and validates (`json`,
`jsonschema`: references outside the code under test), plain batch-mates are untouched, and a
spec the engine cannot compile fails its request alone."""

from __future__ import annotations

import json

import jsonschema
import msgspec
import pytest
import torch

from common.engine.core import LLMEngine
from common.protocol import SamplingSpec
from common.sampling_params import SamplingParams
from common.structured.spec import parse_structured_output
from tests.unit.json_schemas import SCHEMAS, json_ending_bias

MAX_TOKENS = 200  # generous: with the ending bias every schema here ends in under 50 tokens


@pytest.fixture(scope="module")
def engine(tiny_model_path) -> LLMEngine:
    return LLMEngine.from_path(tiny_model_path, num_blocks=256)


@pytest.fixture(scope="module")
def prompt(engine: LLMEngine) -> list[int]:
    assert engine.tokenizer is not None
    return engine.tokenizer.encode("Reply in JSON:")


def schema_params(engine: LLMEngine, schema: dict, **kwargs) -> SamplingParams:
    assert engine.tokenizer is not None
    spec = parse_structured_output(
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    )
    bias = json_ending_bias(engine.tokenizer, engine.model_config.eos_token_ids)
    return SamplingParams(
        max_tokens=MAX_TOKENS, logit_bias=tuple(sorted(bias.items())), structured_output=spec,
        **{"temperature": 0.0, **kwargs},
    )  # fmt: skip


def text_of(engine: LLMEngine, token_ids: list[int]) -> str:
    assert engine.tokenizer is not None
    eos = set(engine.model_config.eos_token_ids)
    assert token_ids and token_ids[-1] in eos, "the grammar ended the output with EOS"
    return engine.tokenizer.decode([t for t in token_ids if t not in eos])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_schema_validates(engine: LLMEngine, prompt: list[int], temperature: float) -> None:
    """All 20 schemas at once in one batch (greedy, then seeded random)."""
    params = [schema_params(engine, s, temperature=temperature, seed=3) for s in SCHEMAS.values()]
    outputs: dict[str, list[int]] = {}
    for name, p in zip(SCHEMAS, params, strict=True):
        engine.add_request(name, prompt, p)
        outputs[name] = []
    while engine.has_unfinished():
        for out in engine.step():
            assert not out.error, out.error
            outputs[out.req_id] += out.new_token_ids
    for name, schema in SCHEMAS.items():
        jsonschema.validate(json.loads(text_of(engine, outputs[name])), schema)


def test_plain_batch_mate_is_untouched(engine: LLMEngine, prompt: list[int]) -> None:
    plain = SamplingParams(max_tokens=24, temperature=0.0)
    [alone] = engine.generate([prompt], plain)
    structured = schema_params(engine, SCHEMAS["nested_object"])
    [structured_alone] = engine.generate([prompt], structured)
    engine.add_request("structured", prompt, structured)
    engine.add_request("plain", prompt, plain)
    outputs: dict[str, list[int]] = {"structured": [], "plain": []}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.req_id] += out.new_token_ids
    assert outputs["plain"] == alone
    assert outputs["structured"] == structured_alone
    assert alone != structured_alone  # the grammar did change the structured one
    jsonschema.validate(json.loads(text_of(engine, structured_alone)), SCHEMAS["nested_object"])


def test_a_spec_that_does_not_compile_fails_alone(engine: LLMEngine, prompt: list[int]) -> None:
    plain = SamplingParams(max_tokens=8, temperature=0.0)
    [alone] = engine.generate([prompt], plain)
    engine.add_request("plain", prompt, plain)
    # Past the HTTP edge's validation (a spec is trusted on the wire), so the engine must cope.
    broken = SamplingParams(
        structured_output='{"schema":{"type":"no-such-type"},"type":"json_schema"}'
    )
    with pytest.raises(ValueError, match="invalid sampling parameter structured_output"):
        engine.add_request("broken", prompt, broken)
    assert "broken" not in engine.requests
    outputs: list[int] = []
    while engine.has_unfinished():
        outputs += [t for out in engine.step() for t in out.new_token_ids]
    assert outputs == alone


def test_logprobs_are_the_raw_models(engine: LLMEngine, prompt: list[int]) -> None:
    """The first token's logprob under a grammar is the raw model's, not the masked one's."""
    params = schema_params(engine, SCHEMAS["string_enum"], logprobs=0)
    engine.add_request("lp", prompt, params)
    [out] = engine.step()
    with torch.no_grad():
        logits = engine.model.forward_prefill(torch.tensor(prompt), [len(prompt)])[-1]
    expected = torch.log_softmax(logits.float(), -1)[out.new_token_ids[0]]
    assert out.logprobs[0].logprob == pytest.approx(float(expected), abs=1e-4)
    assert out.logprobs[0].logprob < -1e-3  # masked logits would make the forced "{" certain
    engine.abort("lp")


def test_spec_travels_and_excludes_ignore_eos_and_min_tokens() -> None:
    spec = parse_structured_output(guided_choice=["yes", "no"])
    params = SamplingParams(structured_output=spec)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(params.to_spec()), type=SamplingSpec)
    assert SamplingParams.from_spec(wire) == params
    plain = SamplingParams().to_spec()
    assert (
        plain.structured_output == "" and SamplingParams.from_spec(plain).structured_output is None
    )
    with pytest.raises(ValueError, match="parameter ignore_eos"):
        SamplingParams(structured_output=spec, ignore_eos=True)
    with pytest.raises(ValueError, match="parameter min_tokens"):
        SamplingParams(structured_output=spec, min_tokens=2, max_tokens=4)
    with pytest.raises(ValueError, match="parameter structured_output"):
        SamplingParams(structured_output="")


def test_a_grammar_past_its_limits_fails_alone(engine: LLMEngine, prompt: list[int]) -> None:
    """Validation accepts this regex (llguidance builds lexers lazily); its first token exceeds
    llguidance's lexer limits, so that request ends with an error and its batch-mate goes on."""
    plain = SamplingParams(max_tokens=8, temperature=0.0)
    [alone] = engine.generate([prompt], plain)
    hostile = SamplingParams(
        max_tokens=8, structured_output=parse_structured_output(guided_regex="(a{1000}){1000}")
    )
    engine.add_request("hostile", prompt, hostile)
    engine.add_request("plain", prompt, plain)
    errors, outputs = {}, []
    while engine.has_unfinished():
        for out in engine.step():
            if out.error:
                errors[out.req_id] = out.error
            elif out.req_id == "plain":
                outputs += out.new_token_ids
    assert list(errors) == ["hostile"] and "does not follow the grammar" in errors["hostile"]
    assert outputs == alone
