"""Driving a launched mesh from tests: staggered arrivals, collected streams, leak checks."""

from __future__ import annotations

from common.protocol import SamplingSpec
from services.launch import Mesh, MeshClient


def run_staggered(
    client: MeshClient, prompts: list[list[int]], sampling: SamplingSpec, wave: int = 4
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


def assert_no_kv_held(mesh: Mesh) -> None:
    for stats in mesh.stats():
        assert stats.kv_blocks_used == 0, f"{stats.service_id} still holds {stats.kv_blocks_used}"
        assert stats.num_requests == 0, f"{stats.service_id} still tracks {stats.num_requests}"
