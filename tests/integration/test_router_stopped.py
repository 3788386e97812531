"""Issue 49's acceptance "the Router SIGSTOPped for 40 s then resumed leaves `num_requests == 0`
within 60 s", in its scaled form: the router's own client (`MeshEngineClient`) runs in a process
of its own over a `LocalMesh`, with a progress deadline of `PROGRESS_S`, and is SIGSTOPped for
`STOP_S` (a few seconds past that deadline) while its greedy streams decode. Resumed, it must end
every stream (with the single-process engine's tokens) and hold no request, and no engine may hold
one either, within `SETTLE_S`. The 40 s form runs by hand on `serve run deploy/local.yaml`
(docs/failures.md)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from common.config import EngineConfig
from common.engine.core import LLMEngine
from common.sampling import SamplingParams
from common.transport.zmq_auth import CurveKeys
from services.launch.local_mesh import LocalMesh, Topology
from services.mesh.registry import ServiceEntry
from tests.conftest import random_prompts

PEERS = mp.get_context("forkserver")
PROGRESS_S = 2.0
STOP_S = PROGRESS_S + 3.0
SETTLE_S = 60.0
GREEDY = SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True)


def run_router(
    model_path: str, entries: list[ServiceEntry], key: str, prompts: list[list[int]],
    report: Connection,
) -> None:  # fmt: skip
    """A router process: its streams, then what it holds, through `report`."""
    from services.router.mesh_client import MeshEngineClient

    client = MeshEngineClient(
        model_path, lambda: entries, auth=CurveKeys.from_mesh_key(key),
        progress_timeout_s=PROGRESS_S,
    )  # fmt: skip

    async def stream(i: int, prompt: list[int], started: asyncio.Event) -> list[int]:
        tokens: list[int] = []
        async for out in client.generate(f"r{i}", prompt, GREEDY):
            assert not out.error, out.error
            tokens += out.new_token_ids
            if len(tokens) >= 8:
                started.set()
        return tokens

    async def run() -> list[list[int]]:
        started = [asyncio.Event() for _ in prompts]
        pairs = enumerate(zip(prompts, started, strict=True))
        tasks = [asyncio.create_task(stream(i, p, e)) for i, (p, e) in pairs]
        await asyncio.gather(*(e.wait() for e in started))
        report.send("decoding")
        return await asyncio.gather(*tasks)

    try:
        tokens = asyncio.run(run())
        report.send((tokens, client.stats().num_requests, client.num_migrations))
    finally:
        client.shutdown()


def test_a_router_stopped_past_its_deadlines_ends_every_stream_and_holds_nothing(
    tiny_model_path: Path,
) -> None:
    prompts = random_prompts([21, 35, 28], 2048, seed=81)
    expected = LLMEngine(EngineConfig(str(tiny_model_path)), with_tokenizer=False).generate(
        prompts, GREEDY
    )
    mesh = LocalMesh.start(Topology(str(tiny_model_path), num_shards=2))
    told, report = PEERS.Pipe(duplex=False)
    router: Any = PEERS.Process(
        target=run_router,
        args=(str(tiny_model_path), mesh.registry.live(), mesh.mesh_key, prompts, report),
        daemon=True,
    )
    try:
        router.start()
        assert told.poll(120) and told.recv() == "decoding"
        os.kill(router.pid, signal.SIGSTOP)
        try:
            time.sleep(STOP_S)  # the stop itself: nothing to wait for but the clock
        finally:
            os.kill(router.pid, signal.SIGCONT)
        resumed = time.monotonic()
        assert told.poll(SETTLE_S), "the router did not end its streams"
        tokens, num_held, _ = told.recv()
        assert tokens == expected
        assert num_held == 0
        while any(s.num_requests for s in mesh.stats()):
            assert time.monotonic() - resumed < SETTLE_S, "an engine still holds a request"
            time.sleep(0.2)  # polling other processes' state
    finally:
        router.kill()
        router.join(timeout=10)
        mesh.close()
