"""The router's own Python per streamed token, without Ray or a model: what `bench/serve.py`'s
router CPU is made of.

    python bench/router_hotpath.py [--batch 32] [--tokens 256] [--stream-interval 8] [--profile]

`batch` streamed `/v1/completions` requests of `--tokens` tokens each go through the real
`Router` app (FastAPI, response shapes, SSE) and a real `InProcessEngineClient` (stream table,
deliveries, coalescing), over an in-memory ASGI transport (`httpx`), from one event loop. The
engine is a stand-in that makes one token per running request every 2 ms step on its own thread
(no model): the figure is the event-loop thread's CPU (`time.thread_time`: router and httpx client
together; the engine thread is not counted) per token, at stream_interval 1 and `N`, side by side.
`--profile` prints cProfile's top functions of the loop at each. The last line is one JSON object.

Under `serve run` the Router replica pays besides for Ray Serve's ASGI bridge and the hop to its
proxy per chunk: `bench/serve.py`'s router CPU minus this is that part.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path[0] = str(REPO)  # NOTE: not bench/, whose profile.py would shadow the stdlib's

from common.engine.request import FinishReason, RequestOutput  # noqa: E402
from common.model.default import default_model_path  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402
from services.router.engine_client import InProcessEngineClient  # noqa: E402
from services.router.server import Router  # noqa: E402
from services.router.streams import StreamInterval  # noqa: E402

STEP_S = 0.002  # a tiny-model decode step at batch 32 on this box
TARGETS = {"router_loop_cpu_ms_per_token_max": 0.3}


class _Blocks:
    num_used_blocks = 0
    num_blocks = 1


class StandInEngine:
    """What `InProcessEngineClient` needs of an `LLMEngine`: one token per request per step."""

    max_model_len = 1 << 16
    tokenizer = None  # its outputs carry their own text: the client makes none

    def __init__(self) -> None:
        self.requests: dict[str, list[int]] = {}  # id: [prompt tokens, output tokens, max]
        self.blocks = _Blocks()

    def add_request(self, req_id: str, prompt: list[int], params: SamplingParams) -> None:
        self.requests[req_id] = [len(prompt), 0, params.max_tokens]

    def abort(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        time.sleep(STEP_S)
        outputs = []
        for req_id, r in list(self.requests.items()):
            r[1] += 1
            done = r[1] >= r[2]
            finish = FinishReason.LENGTH if done else None
            outputs.append(RequestOutput(req_id, [100 + r[1] % 50], " ab", finish, r[0], r[1]))
            if done:
                del self.requests[req_id]
        return outputs


async def one_stream(http: httpx.AsyncClient, tokens: int) -> int:
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": tokens, "stream": True}
    chunks = 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            chunks += line.startswith("data: {")
    return chunks


async def run(router: Router, batch: int, tokens: int, profile: bool) -> dict[str, Any]:
    import cProfile  # NOTE: here, after sys.path no longer starts with bench/ (its profile.py)
    import pstats

    transport = httpx.ASGITransport(app=router.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as http:
        await asyncio.gather(*(one_stream(http, 8) for _ in range(2)))  # warm-up
        profiler = cProfile.Profile() if profile else None
        cpu, wall = time.thread_time(), time.perf_counter()
        if profiler:
            profiler.enable()
        chunks = await asyncio.gather(*(one_stream(http, tokens) for _ in range(batch)))
        if profiler:
            profiler.disable()
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(12)
    return {
        "loop_cpu_ms_per_token": 1e3 * cpu / (batch * tokens),
        "chunks_per_request": sum(chunks) / batch,
        "tok_s": batch * tokens / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--stream-interval", type=int, default=8)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    print(f"batch {args.batch}, {args.tokens} tokens, load {os.getloadavg()}")
    client = InProcessEngineClient(StandInEngine())  # type: ignore[arg-type]
    router = Router(client, default_model_path("tiny"), "tiny")
    results: dict[str, Any] = {"batch": args.batch, "tokens": args.tokens,
                               "load_avg_start": os.getloadavg()}  # fmt: skip
    try:
        for interval in (1, args.stream_interval):
            client.streams.interval = StreamInterval(interval)
            figures = asyncio.run(run(router, args.batch, args.tokens, args.profile))
            print(f"  stream_interval {interval}: "
                  + ", ".join(f"{k} {v:.3g}" for k, v in figures.items()))  # fmt: skip
            results[f"stream_interval_{interval}"] = figures
    finally:
        client.shutdown()
    one, many = results["stream_interval_1"], results[f"stream_interval_{args.stream_interval}"]
    results["cpu_ratio"] = many["loop_cpu_ms_per_token"] / one["loop_cpu_ms_per_token"]
    print(f"  loop CPU per token, interval {args.stream_interval} / 1: {results['cpu_ratio']:.2f}")
    results["load_avg_end"] = os.getloadavg()
    results["targets"] = TARGETS
    results["targets_met"] = {
        "router_loop_cpu_ms_per_token_max": one["loop_cpu_ms_per_token"] <= 0.3,
    }
    print(json.dumps(results))


if __name__ == "__main__":
    main()
