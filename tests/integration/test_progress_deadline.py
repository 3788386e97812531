"""A request whose engine gives it up without a word (here: its token engine is told to abort
it behind the router's back, as an engine does when it cannot send to a router that stopped
reading) is not left waiting forever: after `progress_timeout_s` with no output the router re-runs
it from its tokens, and its output is token for token the single-process engine's. A real
`LocalMesh` (processes, ZeroMQ, UCX) driven by the router's own client."""

from __future__ import annotations

import asyncio

from common.config import EngineConfig
from common.engine.core import LLMEngine
from common.protocol import AbortRequest
from common.sampling import SamplingParams
from services.launch.local_mesh import LocalMesh, Topology
from tests.conftest import random_prompts
from tests.integration.mesh_helpers import assert_no_kv_held

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def test_a_request_its_engine_dropped_silently_is_re_run_after_the_progress_deadline(
    tiny_model_path,
):
    [prompt] = random_prompts([24], vocab=2048, seed=21)
    expected = LLMEngine(EngineConfig(str(tiny_model_path)), with_tokenizer=False).generate(
        [prompt], GREEDY
    )[0]
    mesh = LocalMesh.start(Topology(str(tiny_model_path), num_shards=2))
    try:
        client = mesh.engine_client(progress_timeout_s=1.0)

        async def run() -> list[int]:
            tokens: list[int] = []
            dropped = False
            async for out in client.generate("r", prompt, GREEDY):
                assert not out.error, out.error
                tokens += out.new_token_ids
                if tokens and not dropped:  # decoding: its token engine forgets it, silently
                    stream = client.requests.streams.get("r")
                    assert stream is not None and stream.token_engine is not None
                    wire_id = client.requests.wire_id("r")
                    client._send(stream.token_engine.command_endpoint, AbortRequest(wire_id))
                    dropped = True
            return tokens

        try:
            tokens = asyncio.run(asyncio.wait_for(run(), 60))  # without a deadline: forever
        finally:
            client.shutdown()
        assert tokens == expected
        assert client.num_migrations >= 1
        assert_no_kv_held(mesh)
    finally:
        mesh.close()
