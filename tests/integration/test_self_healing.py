"""A local mesh heals itself: a killed worker is replaced and registered under a new id, and the
token engine's shard group is made whole with the replacement shard (real processes, SIGKILL)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from common.engine.core import LLMEngine
from common.protocol import SamplingSpec
from common.roles import Role
from common.sampling_params import SamplingParams
from services.launch.local_mesh import LocalMesh, Topology
from services.mesh.registry import ServiceEntry
from services.router.mesh_client import MeshEngineClient
from tests.conftest import random_prompts
from tests.integration.mesh_helpers import count_migrations
from tests.integration.mesh_test_client import MeshTestClient

LONG = SamplingSpec(max_tokens=80, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def mesh(tiny_model_path: Path) -> Iterator[LocalMesh]:
    mesh = LocalMesh.start(Topology(str(tiny_model_path), num_shards=2))
    yield mesh
    mesh.close()


def wait_for(check: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "the mesh did not heal in time"
        time.sleep(0.1)  # waiting on other processes' start-up: nothing to block on


def live(mesh: LocalMesh) -> dict[str, ServiceEntry]:
    return {e.service_id: e for e in mesh.registry.live()}


def test_a_killed_shard_is_replaced_and_rejoins_its_group(
    mesh: LocalMesh, tiny_model_path: Path
) -> None:
    """The request in flight keeps decoding on the token engine through the kill, with no router
    to re-run it: its lost heads' KV is rebuilt on the replacement from its tokens (Lamina §5),
    and its greedy tokens equal the single-process engine's."""
    prompt = random_prompts([60], 2048, seed=41)[0]
    reference = LLMEngine.from_path(tiny_model_path, num_blocks=128).generate(
        [prompt], SamplingParams(max_tokens=LONG.max_tokens, temperature=0.0, ignore_eos=True)
    )[0]
    client = MeshTestClient(mesh)
    client.submit("long", prompt, LONG)
    tokens: list[int] = []
    while len(tokens) < 5:  # decoding against both shards now
        tokens += client.recv(timeout=120).token_ids
    shard = mesh.workers["shard-1"]
    shard.proc.kill()
    while not (out := client.recv(timeout=120)).finish_reason:
        tokens += out.token_ids
    assert out.finish_reason == "length" and tokens + out.token_ids == reference, out
    [token] = [s for s in mesh.stats() if s.role == Role.TOKEN]
    assert (token.num_rebuilt, token.num_rebuild_fallbacks) == (1, 0)
    client.close()
    wait_for(lambda: "shard-1.1" in live(mesh))
    assert "shard-1" not in live(mesh)
    replacement = live(mesh)["shard-1.1"]
    assert (replacement.slot, replacement.head_start) == (1, shard.cfg.head_start)
    wait_for(
        lambda: [s.service_id for s in live(mesh)["token-0"].shards] == ["shard-0", "shard-1.1"]
    )
    assert mesh.token[0].shards[1].link_address == replacement.link_address
    assert mesh.supervisor is not None and mesh.supervisor.num_restarts == 1
    # The token engine decodes against the new group: greedy tokens equal the reference engine's.
    prompt = random_prompts([70], 2048, seed=42)[0]
    reference = LLMEngine.from_path(tiny_model_path, num_blocks=128).generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    )[0]
    client = MeshTestClient(mesh)
    client.submit("after", prompt, SamplingSpec(max_tokens=24, temperature=0.0, ignore_eos=True))
    tokens: list[int] = []
    while not (out := client.recv(timeout=120)).finish_reason:
        tokens += out.token_ids
    assert tokens + out.token_ids == reference and out.finish_reason == "length"
    client.close()
    wait_for(lambda: all(s.kv_blocks_used == 0 for s in mesh.stats()))


def test_a_killed_engine_is_replaced_under_a_new_id(mesh: LocalMesh) -> None:
    mesh.workers["prompt-0"].proc.kill()
    wait_for(lambda: "prompt-0.1" in live(mesh))
    assert "prompt-0" not in live(mesh) and live(mesh)["prompt-0.1"].state == "ready"
    assert all(s.num_requests == 0 for s in mesh.stats())  # every service answers


def migrating_streams(
    mesh: LocalMesh,
    prompts: list[list[int]],
    num_tokens: int,
    kill: Callable[[], None],
    migrations: list[int] | None = None,
) -> list[list[int]]:
    """Stream every prompt through the router's `MeshEngineClient`; call `kill` once each has
    a few tokens; return each stream's token ids (the router's migrations go to `migrations`)."""
    model_path = mesh.topology.model_path
    client = MeshEngineClient(model_path, mesh.registry.live, auth=mesh.auth, refresh_s=0.1)
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)

    async def run() -> list[list[int]]:
        started = asyncio.Event()
        counts = [0] * len(prompts)

        async def one(i: int, prompt: list[int]) -> list[int]:
            tokens: list[int] = []
            async for out in client.generate(f"m{i}", prompt, params):
                tokens += out.new_token_ids
                counts[i] = len(tokens)
                if min(counts) >= 5:
                    started.set()
            return tokens

        tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(prompts)]
        await asyncio.wait_for(started.wait(), 120)
        kill()
        return list(await asyncio.wait_for(asyncio.gather(*tasks), 300))

    try:
        return asyncio.run(run())
    finally:
        if migrations is not None:
            migrations.append(client.num_migrations)
        client.shutdown()


@pytest.mark.parametrize("victim", ["shard-1", "token-0", "prompt-0"])
def test_streams_continue_through_a_killed_worker(tiny_model_path: Path, victim: str) -> None:
    """Six greedy streams; one worker SIGKILLed mid-stream: every stream finishes with exactly
    the single-process engine's tokens, and no KV is left. A dead engine's requests migrate
    (re-run from the tokens they had); a dead shard costs only its heads: none migrates, the
    token engine keeps every request and a prompt engine rebuilds the lost heads' KV on the
    replacement (Lamina §5)."""
    prompts = random_prompts([20, 45, 70, 95, 120, 33], 2048, seed=50)
    reference = LLMEngine.from_path(tiny_model_path, num_blocks=256).generate(
        prompts, SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    )
    mesh = LocalMesh.start(Topology(str(tiny_model_path), num_shards=2))
    try:
        migrations: list[int] = []
        outputs = migrating_streams(
            mesh, prompts, 120, lambda: mesh.workers[victim].proc.kill(), migrations
        )
        assert outputs == reference
        supervisor = mesh.supervisor
        assert supervisor is not None
        wait_for(lambda: supervisor.num_restarts == 1)  # the streams need not wait for it
        if victim.startswith("shard"):
            assert migrations == [0]
            [token] = [s for s in mesh.stats() if s.role == Role.TOKEN]
            assert (token.num_rebuilt, token.num_rebuild_fallbacks) == (len(prompts), 0)
        wait_for(lambda: all(s.kv_blocks_used == 0 and s.num_requests == 0 for s in mesh.stats()))
    finally:
        mesh.close()


def test_a_registry_that_forgets_everyone_briefly_moves_no_request(mesh: LocalMesh) -> None:
    """A restarted registry actor knows no replica until each heartbeats again (about a second):
    the router must not take that for every engine leaving. Its view of the registry goes empty
    for a second mid-stream; every stream finishes on its engines, none migrates."""
    forgetting_until = [0.0]

    def registry_view() -> list[ServiceEntry]:
        return [] if time.monotonic() < forgetting_until[0] else mesh.registry.live()

    client = MeshEngineClient(
        mesh.topology.model_path, registry_view, auth=mesh.auth, refresh_s=0.1
    )
    migrations = count_migrations(client)
    prompts = random_prompts([30, 50], 2048, seed=61)
    expected = LLMEngine.from_path(mesh.topology.model_path, num_blocks=256).generate(
        prompts, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    )
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)

    async def run() -> list[list[int]]:
        async def one(i: int, prompt: list[int]) -> list[int]:
            tokens: list[int] = []
            async for out in client.generate(f"r{i}", prompt, params):
                tokens += out.new_token_ids
                if i == 0 and len(tokens) == 5:
                    forgetting_until[0] = time.monotonic() + 1.0
            return tokens

        tasks = [one(i, prompt) for i, prompt in enumerate(prompts)]
        return list(await asyncio.wait_for(asyncio.gather(*tasks), 120))

    try:
        assert asyncio.run(run()) == expected
        assert migrations == []
    finally:
        client.shutdown()
