"""Structured outputs across the mesh: the prompt engine samples the first token under the
grammar, the token engine rebuilds the matcher from the hand-off's tokens and decodes against two
attention shards. The output validates (`jsonschema`) and equals the single-process engine's; so
do a Lark grammar's, and vLLM's `allowed_token_ids` and `bad_words` (which cross the wire in the
sampling spec)."""

from __future__ import annotations

import json

import jsonschema

from common.engine.core import LLMEngine
from common.sampling_params import SamplingParams
from common.structured.spec import parse_structured_output
from common.tokenizer import Tokenizer
from services.launch.local_mesh import LocalMesh, Topology
from tests.integration.mesh_helpers import assert_no_kv_held
from tests.integration.mesh_test_client import MeshTestClient
from tests.unit.json_schemas import SCHEMAS, json_ending_bias

NAMES = ["nested_object", "array_of_objects", "string_pattern", "recursive_tree"]


def test_json_schema_handed_off_validates_and_matches_engine(tiny_model_path) -> None:
    tokenizer = Tokenizer(tiny_model_path)
    reference = LLMEngine.from_path(tiny_model_path, num_blocks=256)
    eos = reference.model_config.eos_token_ids
    bias = tuple(sorted(json_ending_bias(tokenizer, eos).items()))
    prompt = tokenizer.encode("Reply in JSON:")
    params = {
        name: SamplingParams(
            max_tokens=200,
            temperature=0.0,
            logit_bias=bias,
            structured_output=parse_structured_output(guided_json=SCHEMAS[name]),
        )  # fmt: skip
        for name in NAMES
    }
    plain = reference.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0]
    extras = {
        "lark": SamplingParams(max_tokens=20, temperature=0.0, structured_output=(
            parse_structured_output(guided_grammar='start: "ok " NUM\nNUM: /[0-9]{2}/'))),
        "allowed": SamplingParams(max_tokens=12, temperature=0.0, allowed_token_ids=(40, 41, 42)),
        "bad_words": SamplingParams(max_tokens=12, temperature=0.0,
                                    bad_words=((plain[0], plain[1]), (plain[3],))),
    }  # fmt: skip
    params |= extras
    expected = {name: reference.generate([prompt], p)[0] for name, p in params.items()}
    assert set(expected["allowed"]) <= {40, 41, 42} and plain[3] not in expected["bad_words"]
    assert expected["bad_words"][:2] != plain[:2]
    # Past the HTTP edge's validation: the engine that compiles it fails this request alone.
    broken = SamplingParams(structured_output='{"schema":{"type":"bogus"},"type":"json_schema"}')
    mesh = LocalMesh.start(Topology(str(tiny_model_path), num_token=1, num_shards=2))
    try:
        client = MeshTestClient(mesh)
        client.submit("broken", prompt, broken.to_spec())
        for name, p in params.items():
            client.submit(name, prompt, p.to_spec())
        outputs: dict[str, list[int]] = {name: [] for name in params}
        done: set[str] = set()
        while len(done) < len(params) + 1:
            out = client.recv(timeout=120)
            if out.req_id == "broken":
                assert "structured_output" in out.error and not out.retryable
                done.add(out.req_id)
                continue
            assert not out.error, out.error
            outputs[out.req_id] += out.token_ids
            if out.finish_reason:
                done.add(out.req_id)
        for name in NAMES:
            assert outputs[name] == expected[name], name
            assert outputs[name][-1] in eos  # ended by the grammar, not by max_tokens
            text = tokenizer.decode(outputs[name][:-1])
            jsonschema.validate(json.loads(text), SCHEMAS[name])
        for name in extras:
            assert outputs[name] == expected[name], name
        assert tokenizer.decode(outputs["lark"][:-1]).startswith("ok ")
        assert_no_kv_held(mesh)
    finally:
        mesh.close()
