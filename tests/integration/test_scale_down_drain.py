"""Scale-down drains (issue 50): the replica Serve stops leaves routing, then finishes its work.

Real mesh replicas as Serve runs them (`start_engine`: an engine worker on its thread, its
registry membership heartbeating), in this process with the plain `Registry`, and the router's
own `MeshEngineClient` over ZeroMQ: one prompt engine and two token engines with local attention.
One token engine is shut down (`MeshReplica.shutdown`, what Serve's graceful stop calls through
the deployment's `__del__`) while it decodes: its entry turns `draining`, every request placed
after that goes to the other token engine, the ones it holds finish on it (no migration), and
only then does it leave the registry. Every stream equals the single-process engine's tokens.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from common.engine.core import LLMEngine
from common.mesh_options import MeshOptions
from common.roles import Role
from common.sampling import SamplingParams
from common.transport.zmq_auth import CurveKeys
from common.worker_config import WorkerConfig
from services.engine.worker import EngineWorker
from services.mesh.registry import Registry
from services.mesh.replica import MeshReplica, start_engine
from services.router.mesh_client import MeshEngineClient
from tests.conftest import random_prompts

NUM_TOKENS = 48
Replicas = tuple[Registry, WorkerConfig, dict[str, MeshReplica]]


@pytest.fixture
def replicas(tiny_model_path: Path) -> Iterator[Replicas]:
    options = MeshOptions(num_blocks=256, shards_per_group=0, host="127.0.0.1")
    base = WorkerConfig(service_id="", model_path=str(tiny_model_path), ready_endpoint="",
                        host="127.0.0.1", served_model_name="tiny",
                        mesh_key=secrets.token_hex(32), options=options)  # fmt: skip
    registry = Registry()
    started: dict[str, MeshReplica] = {}
    try:
        for role, service_id in ((Role.PROMPT, "prompt-0"), (Role.TOKEN, "token-a"),
                                 (Role.TOKEN, "token-b")):  # fmt: skip
            started[service_id] = start_engine(role, service_id, registry, base)
        yield registry, base, started
    finally:
        for replica in started.values():
            if replica.worker.alive():  # not the one the test stopped
                replica.shutdown(drain_s=0)


def held(replica: MeshReplica) -> set[str]:
    worker = replica.worker.worker
    assert isinstance(worker, EngineWorker)
    return set(worker.engine.table.requests)  # a racy read of a dict's keys: a test's glance


def test_a_leaving_token_engine_takes_no_new_work_and_finishes_what_it_holds(
    replicas: Replicas, tiny_model_path: Path
) -> None:
    registry, base, started = replicas
    client = MeshEngineClient(tiny_model_path, registry.live, host="127.0.0.1", refresh_s=0.1,
                              auth=CurveKeys.from_mesh_key(base.mesh_key))  # fmt: skip
    migrations: list[str] = []
    migrate = client._migrate

    async def counted(*args: Any, **kwargs: Any) -> Any:
        migrations.append(str(args[:1]))
        return await migrate(*args, **kwargs)

    client._migrate = counted  # type: ignore[method-assign]
    prompts = random_prompts([24, 40, 56, 72, 30, 50, 70, 90], 2048, seed=71)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    expected = LLMEngine.from_path(tiny_model_path, num_blocks=256).generate(prompts, params)
    first, later = prompts[:4], prompts[4:]
    draining_seen: dict[str, Any] = {}

    async def run() -> list[list[int]]:
        counts = [0] * len(first)
        decoding = asyncio.Event()

        async def one(i: int, prompt: list[int]) -> list[int]:
            tokens: list[int] = []
            async for out in client.generate(f"r{i}", prompt, params):
                tokens += out.new_token_ids
                if i < len(first):
                    counts[i] = len(tokens)
                    if min(counts) >= 3:
                        decoding.set()
            return tokens

        tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(first)]
        await asyncio.wait_for(decoding.wait(), 120)
        # The token engine holding the most of them leaves, as Serve stops a replica.
        name = max(("token-a", "token-b"), key=lambda n: len(held(started[n])))
        leaving = started[name]
        holding = held(leaving)
        assert holding, "neither token engine holds a request"
        stopper = threading.Thread(target=leaving.shutdown, kwargs={"drain_s": 120})
        stopper.start()
        while (entry := {e.service_id: e for e in registry.live()}[name]).state != "draining":
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # the router's next registry read (refresh_s 0.1)
        draining_seen.update(name=name, holding=holding, by_engine=dict(client.requests.by_engine))
        tasks += [asyncio.create_task(one(len(first) + i, p)) for i, p in enumerate(later)]
        outputs = list(await asyncio.wait_for(asyncio.gather(*tasks), 180))
        assert stopper.is_alive() or name not in {e.service_id for e in registry.live()}
        await asyncio.to_thread(stopper.join, 60)
        assert not stopper.is_alive()
        draining_seen["entry"] = entry
        return outputs

    try:
        outputs = asyncio.run(run())
    finally:
        client.shutdown()
    assert outputs == expected
    assert migrations == []  # what the leaving engine held finished there
    name = draining_seen["name"]
    # Nothing placed on it once it was draining; the other token engine took every later one.
    assert client.requests.by_engine[name] == draining_seen["by_engine"].get(name)
    other = "token-b" if name == "token-a" else "token-a"
    assert client.requests.by_engine[other] >= draining_seen["by_engine"].get(other, 0) + len(later)
    assert name not in {e.service_id for e in registry.live()}  # gone once drained
    assert not held(started[name])


def test_requests_placed_just_before_a_router_sees_draining_finish_on_the_leaving_engine(
    replicas: Replicas, tiny_model_path: Path
) -> None:
    """A router reads the registry every so often: requests it places on an engine just as that
    engine turns `draining` still arrive there, after its table was last empty. The engine
    serves on for `DRAIN_NOTICE_S`, so they finish on it instead of being re-run elsewhere.
    Here the router's view is stale for a second after the engine starts to leave: it still
    lists the leaving engine as the only token engine (the other one is news to it)."""
    registry, base, started = replicas
    stale_until = [float("inf")]
    stale = [e for e in registry.live() if e.service_id != "token-b"]

    def registry_view() -> list[Any]:
        return stale if time.monotonic() < stale_until[0] else registry.live()

    client = MeshEngineClient(tiny_model_path, registry_view, host="127.0.0.1", refresh_s=0.1,
                              auth=CurveKeys.from_mesh_key(base.mesh_key))  # fmt: skip
    migrations: list[str] = []
    migrate = client._migrate

    async def counted(*args: Any, **kwargs: Any) -> Any:
        migrations.append(str(args[:1]))
        return await migrate(*args, **kwargs)

    client._migrate = counted  # type: ignore[method-assign]
    prompts = random_prompts([20, 35, 50, 65], 2048, seed=73)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = LLMEngine.from_path(tiny_model_path, num_blocks=256).generate(prompts, params)

    async def run() -> list[list[int]]:
        while not client.ready():
            await asyncio.sleep(0.05)

        async def one(i: int, prompt: list[int]) -> list[int]:
            tokens: list[int] = []
            async for out in client.generate(f"s{i}", prompt, params):
                tokens += out.new_token_ids
            return tokens

        leaving = started["token-a"]
        assert not held(leaving)  # idle: the old drain stopped it at once
        stale_until[0] = time.monotonic() + 1.0
        stopper = threading.Thread(target=leaving.shutdown, kwargs={"drain_s": 60})
        stopper.start()
        while any(e.service_id == "token-a" and e.state == "ready" for e in registry.live()):
            await asyncio.sleep(0.01)  # until it has begun to leave
        tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(prompts)]
        outputs = list(await asyncio.wait_for(asyncio.gather(*tasks), 120))
        await asyncio.to_thread(stopper.join, 60)
        assert not stopper.is_alive()
        return outputs

    try:
        outputs = asyncio.run(run())
    finally:
        client.shutdown()
    assert outputs == expected
    assert client.requests.by_engine["token-a"] == len(prompts)  # all placed on the leaving one
    assert migrations == []  # ... and all finished there
    assert "token-a" not in {e.service_id for e in registry.live()}
