"""Structured outputs: sampling under the grammar mask yields text that `jsonschema` accepts.

The reference is outside the code under test: Python's `json` parses the output and `jsonschema`
validates it. Logits come from a seeded generator (many schemas, cheap) and, for a few schemas,
from the tiny random model itself.
"""

from __future__ import annotations

import json
import re
from functools import cache

import jsonschema
import pytest
import torch

from common.model.default import default_model_path
from common.model.loader import load_model
from common.structured.grammar import GrammarCompiler, GrammarMatcher
from common.structured.masks import apply_masks
from common.structured.spec import parse_structured_output as parse
from common.tokenizer import Tokenizer
from tests.unit.json_schemas import SCHEMAS

MAX_TOKENS = 400
CLOSING, OPENING = set('"}],:'), set("{[")


@cache
def compiler() -> GrammarCompiler:
    folder = default_model_path()
    config = json.loads((folder / "config.json").read_text())
    # 40 padding rows past the tokenizer's vocabulary, as models round their embeddings up.
    return GrammarCompiler.from_model_folder(folder, config["vocab_size"] + 40, eos_ids())


@cache
def tokenizer() -> Tokenizer:
    return Tokenizer(default_model_path())


def eos_ids() -> list[int]:
    return json.loads((default_model_path() / "config.json").read_text())["eos_token_id"]


@cache
def structure_bias() -> torch.Tensor:
    """+5 on tokens made only of JSON punctuation that closes or separates, and on EOS, +3 on
    punctuation that opens: random logits otherwise wander inside strings and numbers for
    thousands of tokens, and nest objects and arrays without end."""
    tok, vocab = tokenizer(), compiler().vocab_size
    bias = torch.zeros(vocab)
    for token_id in range(tok.vocab_size):
        text = tok.decode([token_id])
        if text and set(text) <= CLOSING:
            bias[token_id] = 5.0
        elif text and set(text) <= CLOSING | OPENING:
            bias[token_id] = 3.0
    bias[eos_ids()] = 5.0
    return bias


def json_schema_spec(schema: dict) -> str:
    spec = parse(response_format={
        "type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True},
    })  # fmt: skip
    assert spec is not None
    return spec


def sample_structured(spec: str, seed: int, next_logits=None) -> tuple[str, GrammarMatcher, list]:
    """Sample under the mask until EOS (or MAX_TOKENS); return text, matcher and token ids."""
    matcher = compiler().matcher(spec)
    gen = torch.Generator().manual_seed(seed)
    token_ids: list[int] = []
    for _ in range(MAX_TOKENS):
        if next_logits is None:
            logits = torch.randn(1, compiler().vocab_size, generator=gen) + structure_bias()
        else:
            logits = next_logits(token_ids)  # [1, vocab]
        apply_masks(logits, [matcher])
        token = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=gen))
        assert matcher.accept(token), matcher.error()
        if token in eos_ids():
            break
        token_ids.append(token)
    return tokenizer().decode(token_ids), matcher, token_ids


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_logits_follow_each_schema(name: str) -> None:
    schema = SCHEMAS[name]
    for seed in range(3):
        text, matcher, _ = sample_structured(json_schema_spec(schema), seed)
        assert matcher.is_terminated(), f"no EOS within {MAX_TOKENS} tokens: {text[:200]!r}"
        jsonschema.validate(json.loads(text), schema)


def test_tiny_model_logits_follow_schemas() -> None:
    """The real (random) model's logits, through the mask: three schemas, two seeds each."""
    model = load_model(str(default_model_path()), "float32")
    prompt = tokenizer().encode("Reply in JSON:")
    padding = compiler().vocab_size - model.config.vocab_size

    def next_logits(token_ids: list[int]) -> torch.Tensor:
        ids = prompt + token_ids
        with torch.no_grad():
            logits = model.forward_prefill(torch.tensor(ids), [len(ids)])[-1:]  # [1, vocab]
        return torch.nn.functional.pad(logits, (0, padding))  # the padding rows: masked off

    for name in ("string_enum", "integer_range", "string_pattern"):
        for seed in range(2):
            text, matcher, _ = sample_structured(json_schema_spec(SCHEMAS[name]), seed, next_logits)
            assert matcher.is_terminated(), text[:200]
            jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_json_object_output_is_an_object() -> None:
    spec = parse(response_format={"type": "json_object"})
    assert spec is not None
    for seed in range(5):
        text, matcher, _ = sample_structured(spec, seed)
        assert matcher.is_terminated()
        assert isinstance(json.loads(text), dict)


def test_guided_regex_and_choice() -> None:
    regex = parse(guided_regex=r"[a-c]{2,4}-[0-9]{3}")
    choice = parse(guided_choice=["yes", "no", "a.b (c)"])
    assert regex is not None and choice is not None
    for seed in range(5):
        assert re.fullmatch(r"[a-c]{2,4}-[0-9]{3}", sample_structured(regex, seed)[0])
        assert sample_structured(choice, seed)[0] in {"yes", "no", "a.b (c)"}


def test_replay_matches_token_by_token_acceptance() -> None:
    spec = json_schema_spec(SCHEMAS["array_of_objects"])
    _, _, token_ids = sample_structured(spec, seed=7)
    assert len(token_ids) > 4
    stepped = compiler().matcher(spec)
    vocab = compiler().vocab_size
    for cut in range(len(token_ids) + 1):
        replayed = compiler().matcher(spec, token_ids[:cut])
        masks = torch.full((2, vocab), 0.0)
        apply_masks(masks, [stepped, replayed])
        assert torch.equal(masks[0], masks[1]), f"masks differ after {cut} tokens"
        assert stepped.is_accepting() == replayed.is_accepting()
        if cut < len(token_ids):
            assert stepped.accept(token_ids[cut])
    assert stepped.is_accepting()


def test_replay_refuses_tokens_off_the_grammar() -> None:
    spec = json_schema_spec(SCHEMAS["flat_required"])
    with pytest.raises(ValueError, match="do not follow the grammar"):
        compiler().matcher(spec, tokenizer().encode("[1]", add_special_tokens=False))


def test_eos_only_when_complete_and_only_eos_when_terminated() -> None:
    spec = json_schema_spec({"type": "object", "properties": {"n": {"type": "integer"}},
                             "required": ["n"], "additionalProperties": False})  # fmt: skip
    vocab, eos = compiler().vocab_size, eos_ids()

    def allowed(matcher: GrammarMatcher) -> set[int]:
        logits = torch.zeros(1, vocab)
        apply_masks(logits, [matcher])
        return set(torch.nonzero(torch.isfinite(logits[0])).flatten().tolist())

    partial = compiler().matcher(spec, tokenizer().encode('{"n":12', add_special_tokens=False))
    assert not set(eos) & allowed(partial) and not partial.is_terminated()
    done = compiler().matcher(spec, tokenizer().encode('{"n":12}', add_special_tokens=False))
    assert done.is_terminated() and allowed(done) == set(eos)
    assert done.accept(eos[-1])
    number = compiler().matcher(parse(guided_json={"type": "integer"}) or "", [])
    assert number.replay(tokenizer().encode("12", add_special_tokens=False))
    assert set(eos) <= allowed(number) and not number.is_terminated()  # "123" may still come
    tokenizer_vocab = tokenizer().vocab_size
    assert all(t < tokenizer_vocab for t in allowed(compiler().matcher(spec)))


def test_plain_rows_are_untouched_in_a_mixed_batch() -> None:
    spec = parse(response_format={"type": "json_object"})
    assert spec is not None
    logits = torch.randn(4, compiler().vocab_size, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    matchers = [None, compiler().matcher(spec), None, compiler().matcher(spec)]
    assert apply_masks(logits, matchers) == 2
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert torch.isinf(logits[1]).sum() > 0 and torch.isinf(logits[3]).sum() > 0
    kept = torch.isfinite(logits[1])
    assert torch.equal(logits[1][kept], before[1][kept])  # allowed tokens keep their logits
    assert apply_masks(logits, [None] * 4) == 0


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "schema": {"type": "nonsense"}}}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "schema": {"type": "string", "pattern": "(("}}}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "schema": {"not": {"type": "string"}}}}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "schema": {"$ref": "#/$defs/missing"}}}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "bad name!", "schema": {}}}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "schema": [1]}}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": "json"}, "response_format"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": {"type": "string", "minLength": 5, "maxLength": 2}}, "guided_json"),
        ({"guided_json": {"type": "string", "enum": ["x" * 70_000]}}, "guided_json"),
        ({"guided_regex": "a(b"}, "guided_regex"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["ok", 3]}, "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),
    ],
)  # fmt: skip
def test_bad_requests_raise_naming_the_parameter(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=f"^invalid sampling parameter {name}: "):
        parse(**kwargs)


def test_specs_are_canonical_and_text_means_none() -> None:
    a = parse(guided_json={"type": "object", "properties": {"x": {"type": "integer"}}})
    b = parse(guided_json='{"properties": {"x": {"type": "integer"}}, "type": "object"}')
    assert a == b and a is not None and " " not in a
    assert parse(response_format={"type": "text"}) is None and parse() is None


def test_compiled_grammar_cache_is_bounded() -> None:
    small = GrammarCompiler.from_model_folder(
        default_model_path(), compiler().vocab_size, eos_ids(), cache_size=3
    )
    specs = [parse(guided_regex=f"x{{{n}}}") or "" for n in range(1, 6)]
    for spec in specs:
        small.matcher(spec)
    assert small.cached_specs() == 3
    matcher = small.matcher(specs[0])  # evicted, so compiled again: still correct
    assert matcher.replay(tokenizer().encode("x", add_special_tokens=False))
    assert matcher.is_terminated()
