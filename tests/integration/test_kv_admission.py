"""KV admission (issue: capacity at admission): more concurrent requests than their token
engine's KV holds at their whole length all finish, token for token as the single-process engine
decodes them, the ones without room waiting at the router's queue (`kv_queue.py`) instead of
being placed where the shards, or the token engine's own cache, refuse them mid-stream (which
made them re-run, and fail in-band once their migrations ran out). A real `LocalMesh` (processes,
ZeroMQ, UCX) driven by the router's own client."""

from __future__ import annotations

import asyncio

import pytest

from common.config import EngineConfig
from common.engine.core import LLMEngine
from common.mesh_options import MeshOptions
from common.sampling_params import SamplingParams
from services.launch.local_mesh import LocalMesh, Topology
from services.router.streams import AdmissionLimits, Overloaded
from tests.conftest import random_prompts
from tests.integration.mesh_helpers import assert_no_kv_held

NUM_REQUESTS = 8
MAX_TOKENS = 60  # with a 20-token prompt: 80 tokens, 5 blocks of 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


async def run_all(client, prompts, params=GREEDY):  # type: ignore[no-untyped-def]
    async def one(i: int, prompt: list[int]) -> tuple[list[int], str, str]:
        tokens, reason, error = [], "", ""
        async for out in client.generate(f"r{i}", prompt, params):
            tokens += out.new_token_ids
            reason, error = str(out.finish_reason or ""), out.error or error
        return tokens, reason, error

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


@pytest.mark.parametrize("num_shards", [2, 0], ids=["shard-group", "local-kv"])
def test_more_requests_than_kv_all_finish_in_order_of_room(tiny_model_path, num_shards):
    prompts = random_prompts([20] * NUM_REQUESTS, vocab=2048, seed=11)
    reference = LLMEngine(EngineConfig(str(tiny_model_path)), with_tokenizer=False)
    expected = reference.generate(prompts, GREEDY)
    # Room for two requests' whole length at a time, where their decode KV lives.
    options = MeshOptions(shard_num_blocks=12, token_num_blocks=12)
    topology = Topology(str(tiny_model_path), num_shards=num_shards, options=options)
    mesh = LocalMesh.start(topology)
    try:
        client = mesh.engine_client()
        try:

            async def when_known():  # type: ignore[no-untyped-def]
                await until(lambda: knows_kv_room(client))
                return await run_all(client, prompts)

            results = asyncio.run(when_known())
        finally:
            client.shutdown()
        assert [error for _, _, error in results] == [""] * NUM_REQUESTS
        assert [reason for _, reason, _ in results] == ["length"] * NUM_REQUESTS
        assert [tokens for tokens, _, _ in results] == expected
        assert client.kv_queue.num_waited > 0  # some had to wait for room
        assert client.num_migrations == 0  # and none was placed where it did not fit
        assert_no_kv_held(mesh)
    finally:
        mesh.close()


def test_a_full_queue_refuses_before_the_first_byte_and_one_that_never_fits_is_a_400(
    tiny_model_path,
):
    options = MeshOptions(shard_num_blocks=12)
    mesh = LocalMesh.start(Topology(str(tiny_model_path), num_shards=2, options=options))
    client = mesh.engine_client(limits=AdmissionLimits(max_waiting_requests=1, kv_wait_s=60))
    prompts = random_prompts([20] * 4, vocab=2048, seed=12)

    async def scenario() -> None:
        await until(lambda: knows_kv_room(client))
        running = asyncio.ensure_future(run_all(client, prompts[:3]))
        await until(lambda: len(client.kv_queue) == 1)  # two run, one waits: the queue is full
        with pytest.raises(Overloaded):
            await anext(client.generate("late", prompts[3], GREEDY))
        never = SamplingParams(max_tokens=1000, temperature=0.0)  # 12 blocks hold 192 tokens
        with pytest.raises(ValueError, match="max_tokens"):
            await anext(client.generate("huge", prompts[3], never))
        done = await running
        assert [reason for _, reason, _ in done] == ["length"] * 3

    try:
        asyncio.run(scenario())
    finally:
        client.shutdown()
        mesh.close()


def knows_kv_room(client) -> bool:  # type: ignore[no-untyped-def]
    """The router has heard every token engine's KV room (a report from each)."""
    loads = client.scheduler.loads()
    return bool(loads) and all(
        load.free_kv_tokens < 1 << 62 for sid, load in loads.items() if sid.startswith("token")
    )


async def until(condition, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    """Wait for `condition` (another process's reports, or this loop's waiters), bounded."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_requests_that_outgrow_the_shards_together_are_preempted_and_recomputed(tiny_model_path):
    """Shard KV grows on demand (issue 49 item 1): each request fits the group alone, four do not
    at their whole length, and the router admits them by what they hold now. When a decode step
    cannot grow one, the token engine preempts the youngest (the mixed policy's rules), frees
    its KV on the shards and later prefills its prompt and tokens so far again, a chunk a step
    (a chunk of 16 tokens here: the recompute is several): every request finishes, token for
    token as the single-process engine decodes it, none migrated."""
    greedy = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)  # 112: 7 blocks
    prompts = random_prompts([12] * 4, vocab=2048, seed=13)
    reference = LLMEngine(EngineConfig(str(tiny_model_path)), with_tokenizer=False)
    expected = reference.generate(prompts, greedy)
    # One request's whole length, not two; recomputes in chunks.
    options = MeshOptions(shard_num_blocks=8, prefill_chunk_tokens=16)
    mesh = LocalMesh.start(Topology(str(tiny_model_path), num_shards=2, options=options))
    client = mesh.engine_client()

    async def scenario():  # type: ignore[no-untyped-def]
        await until(lambda: knows_kv_room(client))
        return await run_all(client, prompts, greedy)

    try:
        results = asyncio.run(scenario())
        assert [error for _, _, error in results] == [""] * 4
        assert [tokens for tokens, _, _ in results] == expected
        services = client.stats().services.values()
        assert sum(s["num_preemptions"] for s in services) > 0
        assert sum(s["num_prefill_chunks"] for s in services) > 0
        assert client.num_migrations == 0  # recomputed where it was, not re-run elsewhere
        assert_no_kv_held(mesh)
    finally:
        client.shutdown()
        mesh.close()
