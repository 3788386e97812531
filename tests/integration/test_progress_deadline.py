"""A request whose engine gives it up without a word (here: its token engine is told to abort
it behind the router's back, as an engine does when it cannot send to a router that stopped
reading) is not left waiting forever: after `progress_timeout_s` with no output the router re-runs
it from its tokens, and its output is token for token the single-process engine's. A real
`LocalMesh` (processes, ZeroMQ, UCX) driven by the router's own client."""

from __future__ import annotations

import asyncio
import time

import zmq

from common.config import EngineConfig
from common.engine.core import LLMEngine
from common.mesh_options import MeshOptions
from common.protocol import AbortRequest, OutputsDropped, SamplingSpec
from common.sampling_params import SamplingParams
from common.transport.zmq_sockets import PushPool
from services.launch.local_mesh import LocalMesh, Topology
from tests.conftest import random_prompts
from tests.integration.mesh_helpers import assert_no_kv_held
from tests.integration.mesh_test_client import MeshTestClient

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


# A re-run that waits in the router for room (issue 49). The token engine's own KV holds the
# re-run's whole length (a prompt of 20 + max_tokens, in blocks of 16) or another router's long
# request's (`HOLDER`), not both; nor the re-run's and a new request's (`LATE`).
ROOM_BLOCKS = 260
RERUN = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)  # 14 blocks
HOLDER = SamplingSpec(max_tokens=4000, temperature=0.0, ignore_eos=True)  # 252 blocks
LATE = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)  # 252 blocks
PROGRESS_S = 2.0  # the router's deadline, and the engines' (their keep-alives: a third of it)
HELD_S = PROGRESS_S + 1.0  # the holder keeps the room at least this long


def test_a_re_run_waiting_in_the_router_for_room_is_not_re_run_again_and_goes_first(
    tiny_model_path,
):
    """The request's token engine says it gave the request up (the `OutputsDropped` an engine
    sends a router it cannot queue outputs for, sent here by the test on the router's inbox
    socket); its re-run finds the room taken by another router's request (the one of the two
    that its token engine admitted first: the other waited there), and waits in the router
    longer than the progress deadline. It is not re-run again (the deadline restarts when it
    is sent), a new request arriving meanwhile is not placed ahead of it, and its output is
    token for token the single-process engine's."""
    prompt, holder_prompt, late_prompt = random_prompts([20] * 3, vocab=2048, seed=22)
    expected = LLMEngine(EngineConfig(str(tiny_model_path)), with_tokenizer=False).generate(
        [prompt], RERUN
    )[0]
    options = MeshOptions(token_num_blocks=ROOM_BLOCKS, progress_timeout_s=PROGRESS_S,
                          shard_rebuild_wait_s=0)  # fmt: skip
    mesh = LocalMesh.start(Topology(str(tiny_model_path), num_shards=0, options=options))
    other = MeshTestClient(mesh)  # another router: straight to the engines
    notices: PushPool[OutputsDropped] = PushPool(zmq.Context.instance(), OutputsDropped,
                                                 auth=mesh.auth)  # fmt: skip
    client = mesh.engine_client(progress_timeout_s=PROGRESS_S)
    arrivals: dict[str, list[float]] = {"r": [], "late": []}  # when each output came

    async def stream(req_id: str, prompt: list[int], params: SamplingParams) -> list[int]:
        tokens: list[int] = []
        async for out in client.generate(req_id, prompt, params):
            assert not out.error, out.error
            tokens += out.new_token_ids
            arrivals[req_id].append(time.monotonic())
            if req_id == "late" and tokens:
                break  # placed: that is all it shows (its close aborts it)
        return tokens

    async def drain_other() -> None:  # its replies read, so its engine never drops them
        while True:
            while other.replies.recv_nowait() is not None:
                pass
            await asyncio.sleep(0.05)

    async def until(check) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + 60
        while not await check():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.02)

    async def scenario() -> list[int]:
        draining = asyncio.ensure_future(drain_other())
        running = asyncio.ensure_future(stream("r", prompt, RERUN))

        async def sent() -> bool:
            return client.requests.streams.get("r") is not None

        await until(sent)
        other.submit("holder", holder_prompt, HOLDER, token_engine=mesh.token[0])

        async def both_there() -> bool:  # one decodes, the other's hand-off waits for room
            stats = await asyncio.to_thread(mesh.stats)
            return any(s.service_id == mesh.token[0].service_id and s.num_requests == 2
                       for s in stats)  # fmt: skip

        await until(both_there)
        notices.get(client.reply_endpoint).send(
            OutputsDropped([client.requests.wire_id("r")], "the test: its outputs were dropped")
        )

        async def migrated() -> bool:
            return client.num_migrations == 1

        await until(migrated)
        migrated_at = time.monotonic()  # what "r" streams from now on is its re-run's
        late = asyncio.ensure_future(stream("late", late_prompt, LATE))
        await asyncio.sleep(HELD_S)
        other.abort("holder")  # the room frees: for the re-run first
        tokens = await running
        await late
        draining.cancel()
        rerun_first_at = min(t for t in arrivals["r"] if t > migrated_at)
        assert rerun_first_at - migrated_at > PROGRESS_S  # it did wait past the deadline
        assert arrivals["late"][0] > rerun_first_at  # the new request came second
        return tokens

    try:
        tokens = asyncio.run(asyncio.wait_for(scenario(), 120))
        assert client.num_migrations == 1  # its wait in the router was not taken for a loss
        assert tokens == expected
    finally:
        client.shutdown()
        other.close()
        notices.close()
    try:
        assert_no_kv_held(mesh)
    finally:
        mesh.close()
