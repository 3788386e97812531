"""Driving a launched mesh from tests: staggered arrivals, collected streams, leak checks."""

from __future__ import annotations

import os
import time
from typing import Any

from common.protocol import SamplingSpec
from common.roles import Role
from common.sampling_params import SamplingParams
from services.launch.core_pinning import place_decode_groups
from services.launch.local_mesh import LocalMesh
from services.router.mesh_client import MeshEngineClient
from tests.integration.mesh_test_client import MeshTestClient


def run_staggered(
    client: MeshTestClient, prompts: list[list[int]], sampling: SamplingSpec, wave: int = 4
) -> dict[str, list[int]]:
    """Submit `wave` requests, wait for a few tokens, submit the next wave, ... until all finish.

    Requests therefore join while others are prefilling and decoding.
    """
    outputs: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    live = 0
    while pending or live:
        if pending and (live == 0 or sum(map(len, outputs.values())) >= 3 * len(outputs)):
            for i, prompt in pending[:wave]:
                client.submit(f"req-{i}", prompt, sampling)
                outputs[f"req-{i}"] = []
                live += 1
            pending = pending[wave:]
        out = client.recv(timeout=120)
        assert not out.error, out.error
        outputs[out.req_id] += out.token_ids
        if out.finish_reason:
            live -= 1
    return outputs


def assert_no_kv_held(mesh: LocalMesh, timeout_s: float = 10.0) -> None:
    """Every service back to idle. Frees travel apart from the last token (a shard may answer a
    stats request before the free behind it lands), so idle is awaited, within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = mesh.stats()
        if all(s.kv_blocks_used == 0 and s.num_requests == 0 for s in stats):
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)  # polling other processes' state
    for s in stats:
        assert s.kv_blocks_used == 0, f"{s.service_id} still holds {s.kv_blocks_used}"
        assert s.num_requests == 0, f"{s.service_id} still tracks {s.num_requests}"


def assert_decode_groups_pinned(mesh: LocalMesh) -> None:
    """Every thread of each shard and token engine runs on the cores its placement gave it;
    prompt engines are free. `LocalMesh.procs` holds the shards first, then token engines, then
    prompt engines."""
    t = mesh.topology
    everywhere = os.sched_getaffinity(0)
    placements = place_decode_groups(
        t.num_token, t.shards_per_group, sorted(everywhere), t.options.threads_of(Role.TOKEN)
    )
    expected = [set(c) or everywhere for p in placements for c in p.shards]
    expected += [set(p.engine) or everywhere for p in placements]
    expected += [everywhere] * t.num_prompt
    for proc, cores in zip(mesh.procs, expected, strict=True):
        for tid in os.listdir(f"/proc/{proc.pid}/task"):
            assert os.sched_getaffinity(int(tid)) == cores, (proc.args[-1][:80], tid)


def count_migrations(client: MeshEngineClient) -> list[str]:
    """The router client's re-runs from now on, one entry per re-run (the request it moved)."""
    migrations: list[str] = []
    migrate = client._migrate

    async def counted(*args: Any, **kwargs: Any) -> Any:
        migrations.append(str(args[:1]))
        return await migrate(*args, **kwargs)

    client._migrate = counted  # type: ignore[method-assign]
    return migrations


async def collect(
    client: MeshEngineClient, req_id: str, prompt: list[int], params: SamplingParams
) -> list[int]:
    """One request through the router's client: every token it streams."""
    tokens: list[int] = []
    async for out in client.generate(req_id, prompt, params):
        tokens += out.new_token_ids
    return tokens
