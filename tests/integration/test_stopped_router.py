"""A router that stops: nothing it holds is stranded, and nothing its engines drop goes untold.

- A router that stops reading its inbox: its token engine, whose queue to it fills, gives the
  requests up and says so (`OutputsDropped`, services/engine/dropped_outputs.py) on a socket of
  its own, so the notice is among the first things the router reads when it reads again (not
  behind the token backlog, not at its progress deadline); the router turns it into a retryable
  error of each request's current attempt and re-runs them at once (tests/unit/test_mesh_inbox.py).
  The router's inbox here is a PULL socket with small buffers (nothing reads it), so the token
  engine's queue fills in a few hundred steps; requests ask for top logprobs, which makes every
  output its own, larger message.
- Issue 49's acceptance "the Router SIGSTOPped for 40 s then resumed leaves `num_requests == 0`
  within 60 s", in its scaled form: the router's own client (`MeshEngineClient`) runs in a
  process of its own, with a progress deadline of `PROGRESS_S`, and is SIGSTOPped for `STOP_S` (a
  few seconds past that deadline) while its greedy streams decode. Resumed, it must end every
  stream with the single-process engine's tokens and hold no request, and no engine may hold one
  either, within `SETTLE_S`. The 40 s form, on `serve run deploy/local.yaml`, is
  `bench/chaos.py --only stops` (`router_stop`).

One real `LocalMesh` for both (processes, ZeroMQ, UCX).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import zmq

from common.config import EngineConfig
from common.engine.core import LLMEngine
from common.mesh_options import MeshOptions
from common.protocol import OutputsDropped, SamplingSpec, ServiceReply, TokenBatch, TokenOutput
from common.sampling_params import SamplingParams
from common.transport.zmq_auth import CurveKeys
from common.transport.zmq_sockets import TypedSocket
from services.launch.local_mesh import LocalMesh, Topology
from services.mesh.registry import ServiceEntry
from tests.conftest import random_prompts
from tests.integration.mesh_helpers import assert_no_kv_held
from tests.integration.mesh_test_client import MeshTestClient

PEERS = mp.get_context("forkserver")
PROGRESS_S = 2.0
STOP_S = PROGRESS_S + 3.0
SETTLE_S = 60.0
GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
# Enough output to fill the token engine's queue to a router that reads nothing, whatever the
# kernel lends its socket: ZeroMQ's 1,000 messages plus a send buffer that autotunes up to a
# few MiB are a fraction of these requests' messages (one each per token, with top logprobs).
NUM_DROPPED, MAX_TOKENS = 8, 3000


@pytest.fixture(scope="module")
def mesh(tiny_model_path: Path) -> Iterator[LocalMesh]:
    # The token engine holds every dropping request's KV whole (no preemption while its queue
    # fills): NUM_DROPPED requests to the end of MAX_TOKENS.
    options = MeshOptions(token_num_blocks=-(-NUM_DROPPED * (MAX_TOKENS + 20) // 16))
    mesh = LocalMesh.start(Topology(str(tiny_model_path), options=options))
    yield mesh
    mesh.close()


def small_inbox(mesh: LocalMesh) -> tuple[TypedSocket[ServiceReply], str]:
    """A router inbox that holds little: one message queued, a 4 KiB kernel buffer."""
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    mesh.auth.serve(sock)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return TypedSocket(sock, ServiceReply), f"tcp://127.0.0.1:{port}"


def test_an_engine_that_drops_a_routers_outputs_tells_it_ahead_of_the_backlog(
    mesh: LocalMesh,
) -> None:
    client = MeshTestClient(mesh)
    client.replies, client.reply_endpoint = small_inbox(mesh)
    sampling = SamplingSpec(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=20)
    req_ids = [f"r{i}" for i in range(NUM_DROPPED)]
    prompts = random_prompts([20] * NUM_DROPPED, 2048, seed=71)
    for req_id, prompt in zip(req_ids, prompts, strict=True):
        client.submit(req_id, prompt, sampling, token_engine=mesh.token[0])
    # The router reads nothing: the token engine's queue to it fills and it gives up.
    deadline = time.monotonic() + 120
    while any(s.num_requests for s in mesh.stats()):
        assert time.monotonic() < deadline, "the engines still hold the requests"
        time.sleep(0.2)  # polling other processes' state
    # It reads again: the notice comes among the first messages, not after the backlog.
    num_read, told, finished = 0, set(), set()
    while told | finished != set(req_ids):
        item = client.replies.recv(timeout_s=30)
        assert item is not None, f"no word of {set(req_ids) - told - finished}"
        num_read += 1
        if isinstance(item[1], OutputsDropped):
            assert "could not queue" in item[1].error
            assert num_read < 100, num_read  # the backlog is hundreds of messages long
            told |= set(item[1].req_ids)
        elif isinstance(item[1], TokenOutput | TokenBatch):
            outs = item[1].outputs() if isinstance(item[1], TokenBatch) else [item[1]]
            finished |= {o.req_id for o in outs if o.finish_reason}
    assert told and not told & finished
    client.close()
    assert_no_kv_held(mesh)


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
    mesh: LocalMesh, tiny_model_path: Path
) -> None:
    prompts = random_prompts([21, 35, 28], 2048, seed=81)
    expected = LLMEngine(EngineConfig(str(tiny_model_path)), with_tokenizer=False).generate(
        prompts, GREEDY
    )
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
