"""`bench/profile.py`'s decode timed outside its process: B concurrent requests' token times.

`--decode mesh` launches a mesh (`services.launch`) and times tokens at the router's own client
(`MeshDecode`); `--decode URL` streams from a running server's OpenAI API with loadgen's HTTP
client (`HttpDecode`). Either way a decode step is the steady gap between tokens while the whole
batch decodes (`steady_gaps`): requests join one prefill batch after another, so each runs a join
allowance past `--token-size`, doubled until the window is wide enough (`steady_token_times`).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.sampling_params import SamplingParams
    from services.router.mesh_client import MeshEngineClient


def steady_gaps(token_times: list[list[float]]) -> list[float]:
    """Gaps between consecutive tokens while every request of the batch was decoding: after the
    last request's second token (its first from the token engine) and up to the first finish."""
    start = max(times[1] for times in token_times)
    end = min(times[-1] for times in token_times)
    pairs = ((a, b) for times in token_times for a, b in zip(times, times[1:], strict=False))
    return [b - a for a, b in pairs if start <= a < b <= end]


class MeshDecode:
    """Decode through a launched mesh (`services.launch`), timed at the router's own client."""

    def __init__(self, model_path: str, num_shards: int, num_blocks: int) -> None:
        from common.mesh_options import MeshOptions
        from services.launch.local_mesh import LocalMesh, Topology

        blocks = MeshOptions(num_blocks=num_blocks, shard_num_blocks=num_blocks)
        topology = Topology(model_path, 1, 1, num_shards, options=blocks)
        self.mesh = LocalMesh.start(topology)
        self.client = self.mesh.engine_client()
        self._num_batches = 0

    def token_times(self, prompts: list[list[int]], max_tokens: int) -> list[list[float]]:
        from common.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self._num_batches += 1
        tag = f"profile-{self._num_batches}"
        return asyncio.run(stream_token_times(self.client, prompts, params, tag))

    def close(self) -> None:
        self.client.shutdown()
        self.mesh.close()


async def stream_token_times(
    client: MeshEngineClient, prompts: list[list[int]], params: SamplingParams, tag: str
) -> list[list[float]]:
    """Each request's token arrival times (`time.monotonic`), the prompts sent at once through
    the router's client (request `<tag>-<i>`)."""

    async def one(i: int, prompt: list[int]) -> list[float]:
        times: list[float] = []
        async for out in client.generate(f"{tag}-{i}", prompt, params):
            if out.error:
                raise RuntimeError(f"mesh request {tag}-{i} failed: {out.error}")
            times += [time.monotonic()] * len(out.new_token_ids)
        return times

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


class HttpDecode:
    """Decode through a server's OpenAI API, timed by loadgen's streaming HTTP client."""

    def __init__(self, url: str, vocab: int) -> None:
        from loadgen.commands import wait_for_model

        self.url, self.vocab = url, vocab
        self.model = asyncio.run(wait_for_model(url, {}, timeout_s=120.0)).name
        self._num_batches = 0

    def token_times(self, prompts: list[list[int]], max_tokens: int) -> list[list[float]]:
        """Each request's token arrival times (`time.monotonic`), B concurrent requests of the
        prompts' count and length (loadgen's prompt builder makes the ids)."""
        self._num_batches += 1
        return asyncio.run(self._replay(len(prompts), len(prompts[0]), max_tokens))

    async def _replay(
        self, batch_size: int, prompt_size: int, max_tokens: int
    ) -> list[list[float]]:
        from loadgen.http_target import OpenAIStreamingTarget
        from loadgen.prompts import PromptBuilder
        from loadgen.replay import replay
        from loadgen.target import RequestSpec

        prompts = PromptBuilder(vocab_size=self.vocab, seed=self._num_batches)
        target = OpenAIStreamingTarget(self.url, self.model, prompts=prompts)
        specs = [RequestSpec(i, 0.0, prompt_size, max_tokens) for i in range(batch_size)]
        origin = time.monotonic()  # the replay's start, within microseconds
        try:
            result = await replay(specs, target, progress=False)
        finally:
            await target.aclose()
        failed = [r.error for r in result.records if not r.ok]
        if failed:
            raise RuntimeError(f"{len(failed)} profile requests failed, first: {failed[0]}")
        return [
            _arrival_times(origin + r.send_s + (r.ttft_s or 0.0), r.itl_s) for r in result.records
        ]

    def close(self) -> None:
        return None


def _arrival_times(first_s: float, gaps_s: list[float]) -> list[float]:
    times = [first_s]
    for gap in gaps_s:
        times.append(times[-1] + gap)
    return times


RemoteDecode = MeshDecode | HttpDecode


def steady_token_times(
    probe: RemoteDecode, prompts: list[list[int]], token_size: int, allowance: int
) -> tuple[list[list[float]], int]:
    """(token times of a batch with a steady window, the join allowance that gave it).

    Requests join the batch one prefill batch (and, over HTTP, one request hand-off) after
    another, so each runs `token_size + allowance` tokens; the allowance doubles until every
    request has at least half of `token_size` gaps while the whole batch decodes."""
    while True:
        times = probe.token_times(prompts, token_size + allowance)
        gaps = steady_gaps(times)
        if len(gaps) >= len(prompts) * max(token_size // 2, 1) or allowance >= 1024:
            if not gaps:
                raise RuntimeError("no steady decode window: raise --token-size")
            return times, allowance
        allowance *= 2


def remote_decode_ms(
    probe: RemoteDecode, prompts: list[list[int]], token_size: int, allowance: int
) -> tuple[float, int]:
    """(median steady decode gap in ms, the join allowance used); see `steady_token_times`."""
    times, allowance = steady_token_times(probe, prompts, token_size, allowance)
    return 1e3 * statistics.median(steady_gaps(times)), allowance
