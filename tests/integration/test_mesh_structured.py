"""Structured outputs across the mesh: the prompt engine samples the first token under the
grammar, the token engine rebuilds the matcher from the hand-off's tokens and decodes against two
attention shards. The output validates (`jsonschema`) and equals the single-process engine's."""

from __future__ import annotations

import json

import jsonschema

from common.engine.core import LLMEngine
from common.sampling import SamplingParams
from common.structured import parse_structured_output
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
    expected = {name: reference.generate([prompt], p)[0] for name, p in params.items()}
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
        assert_no_kv_held(mesh)
    finally:
        mesh.close()
