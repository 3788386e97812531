"""Scale-down drains (issue 50): the replica Serve stops leaves routing, then finishes its work.

Real mesh replicas as Serve runs them (`start_engine`: an engine worker on its thread, its
registry membership heartbeating), in this process with the plain `Registry`, and the router's
own `MeshEngineClient` over ZeroMQ: one prompt engine and two token engines with local attention.
One token engine is shut down (`MeshReplica.shutdown`, what Serve's graceful stop calls through
the deployment's `__del__`) while it decodes: its entry turns `draining`, every request placed
after that goes to the other token engine, the ones it holds finish on it (no migration), and
only then does it leave the registry. Every stream equals the single-process engine's tokens.

A token engine with its shard group (two groups of two shards, two token engines) is told to stop
together with its group, as one scale-down of both deployments stops them: the shards serve the
draining engine until it has left, so what it holds finishes on its own group.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from common.engine.core import LLMEngine
from common.mesh_options import MeshOptions
from common.roles import Role
from common.sampling_params import SamplingParams
from common.transport.zmq_auth import CurveKeys
from common.worker_config import WorkerConfig
from services.engine.worker import EngineWorker
from services.mesh.registry import Registry, ServiceEntry
from services.mesh.replica import MeshReplica, start_engine, start_shard
from services.router.mesh_client import MeshEngineClient
from tests.conftest import random_prompts
from tests.integration.mesh_helpers import collect, count_migrations

NUM_TOKENS = 48
Replicas = tuple[Registry, WorkerConfig, dict[str, MeshReplica]]


def worker_base(model_path: Path, options: MeshOptions) -> WorkerConfig:
    """What every replica of the test's mesh shares (`start_engine`, `start_shard`)."""
    return WorkerConfig(service_id="", model_path=str(model_path), ready_endpoint="",
                        host="127.0.0.1", served_model_name="tiny",
                        mesh_key=secrets.token_hex(32), options=options)  # fmt: skip


@pytest.fixture
def replicas(tiny_model_path: Path) -> Iterator[Replicas]:
    base = worker_base(tiny_model_path, MeshOptions(num_blocks=256, shards_per_group=0,
                                                    host="127.0.0.1"))  # fmt: skip
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


def greedy_case(
    model_path: Path, lengths: list[int], seed: int
) -> tuple[list[list[int]], SamplingParams, list[list[int]]]:
    """Prompts of these lengths, greedy parameters, and the single-process engine's tokens."""
    prompts = random_prompts(lengths, 2048, seed=seed)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    return (
        prompts,
        params,
        LLMEngine.from_path(model_path, num_blocks=256).generate(prompts, params),
    )


def busiest(started: dict[str, MeshReplica]) -> str:
    """The token engine holding the most requests."""
    return max(("token-a", "token-b"), key=lambda n: len(held(started[n])))


async def decoding(
    client: MeshEngineClient, prefix: str, prompts: list[list[int]], params: SamplingParams,
    started: dict[str, MeshReplica], check: Callable[[bool, bool], bool],
) -> list[asyncio.Task[list[int]]]:  # fmt: skip
    """The streams of `prompts`, once `check` (of whether each token engine holds one) holds
    (bounded by the caller's gather deadline)."""
    tasks = [asyncio.create_task(collect(client, f"{prefix}{i}", p, params))
             for i, p in enumerate(prompts)]  # fmt: skip
    while not check(bool(held(started["token-a"])), bool(held(started["token-b"]))):
        await asyncio.sleep(0.05)
    return tasks


def router_client(
    list_services: Callable[[], list[ServiceEntry]], base: WorkerConfig
) -> MeshEngineClient:
    """The router's own client over the registry view `list_services`, reading it often."""
    return MeshEngineClient(base.model_path, list_services, host="127.0.0.1", refresh_s=0.1,
                            auth=CurveKeys.from_mesh_key(base.mesh_key))  # fmt: skip


def run_then_close(
    client: MeshEngineClient, main: Coroutine[Any, Any, list[list[int]]]
) -> list[list[int]]:
    try:
        return asyncio.run(main)
    finally:
        client.shutdown()


async def finished(
    streams: list[asyncio.Task[list[int]]], stopper: threading.Thread
) -> list[list[int]]:
    """Every stream's tokens, then the leaving replica's `shutdown` returned (bounded)."""
    outputs = list(await asyncio.wait_for(asyncio.gather(*streams), 180))
    await asyncio.to_thread(stopper.join, 60)
    assert not stopper.is_alive()
    return outputs


def test_a_leaving_token_engine_takes_no_new_work_and_finishes_what_it_holds(
    replicas: Replicas, tiny_model_path: Path
) -> None:
    registry, base, started = replicas
    client = router_client(registry.live, base)
    migrations = count_migrations(client)
    prompts, params, expected = greedy_case(tiny_model_path, [24, 40, 56, 72, 30, 50, 70, 90], 71)
    first, later = prompts[:4], prompts[4:]
    draining_seen: dict[str, Any] = {}

    async def run() -> list[list[int]]:
        tasks = await decoding(client, "r", first, params, started, lambda a, b: a or b)
        # The token engine holding the most of them leaves, as Serve stops a replica.
        name = busiest(started)
        leaving = started[name]
        holding = held(leaving)
        assert holding, "neither token engine holds a request"
        stopper = threading.Thread(target=leaving.shutdown, kwargs={"drain_s": 120})
        stopper.start()
        while {e.service_id: e for e in registry.live()}[name].state != "draining":
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # the router's next registry read (refresh_s 0.1)
        draining_seen.update(name=name, holding=holding, by_engine=dict(client.requests.by_engine))
        tasks += [asyncio.create_task(collect(client, f"r{len(first) + i}", p, params))
                  for i, p in enumerate(later)]  # fmt: skip
        return await finished(tasks, stopper)

    outputs = run_then_close(client, run())
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

    def registry_view() -> list[ServiceEntry]:
        return stale if time.monotonic() < stale_until[0] else registry.live()

    client = router_client(registry_view, base)
    migrations = count_migrations(client)
    prompts = random_prompts([20, 35, 50, 65], 2048, seed=73)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = LLMEngine.from_path(tiny_model_path, num_blocks=256).generate(prompts, params)

    async def run() -> list[list[int]]:
        while not client.ready():
            await asyncio.sleep(0.05)

        leaving = started["token-a"]
        assert not held(leaving)  # idle: the old drain stopped it at once
        stale_until[0] = time.monotonic() + 1.0
        stopper = threading.Thread(target=leaving.shutdown, kwargs={"drain_s": 60})
        stopper.start()
        while any(e.service_id == "token-a" and e.state == "ready" for e in registry.live()):
            await asyncio.sleep(0.01)  # until it has begun to leave
        tasks = [asyncio.create_task(collect(client, f"s{i}", p, params))
                 for i, p in enumerate(prompts)]  # fmt: skip
        return await finished(tasks, stopper)

    outputs = run_then_close(client, run())
    assert outputs == expected
    assert client.requests.by_engine["token-a"] == len(prompts)  # all placed on the leaving one
    assert migrations == []  # ... and all finished there
    assert "token-a" not in {e.service_id for e in registry.live()}


class DepartureLog(Registry):
    """The plain registry, noting the order in which entries leave it (unregister)."""

    def __init__(self) -> None:
        super().__init__()
        self.departed: list[str] = []

    def unregister(self, service_id: str) -> None:
        if service_id in self.entries:
            self.departed.append(service_id)
        super().unregister(service_id)


def test_a_token_engine_stopped_with_its_shard_group_leaves_first_and_finishes_on_it(
    tiny_model_path: Path,
) -> None:
    options = MeshOptions(num_blocks=256, shard_num_blocks=256, shards_per_group=2,
                          host="127.0.0.1", shard_wait_s=30)  # fmt: skip
    base = worker_base(tiny_model_path, options)
    registry = DepartureLog()
    started: dict[str, MeshReplica] = {}
    try:
        for i in range(4):
            started[f"shard-{i}"] = start_shard(f"shard-{i}", registry, base)
        for role, service_id in ((Role.PROMPT, "prompt-0"), (Role.TOKEN, "token-a"),
                                 (Role.TOKEN, "token-b")):  # fmt: skip
            started[service_id] = start_engine(role, service_id, registry, base)
        groups = {e.service_id: {s.service_id for s in e.shards}
                  for e in registry.live() if e.role == Role.TOKEN}  # fmt: skip
        assert all(len(g) == 2 for g in groups.values()) and len(set.union(*groups.values())) == 4
        client = router_client(registry.live, base)
        migrations = count_migrations(client)
        prompts, params, expected = greedy_case(tiny_model_path, [24, 40, 56, 72, 30, 50], 79)
        leaving: dict[str, Any] = {}

        async def run() -> list[list[int]]:
            tasks = await decoding(client, "g", prompts, params, started, lambda a, b: a and b)
            name = busiest(started)
            leaving.update(name=name, shards=groups[name])
            # One scale-down: the engine and its group told to stop at once, shards first.
            stoppers = [threading.Thread(target=started[s].shutdown, kwargs={"drain_s": 120})
                        for s in sorted(groups[name])]  # fmt: skip
            stoppers.append(threading.Thread(target=started[name].shutdown,
                                             kwargs={"drain_s": 120}))  # fmt: skip
            for stopper in stoppers:
                stopper.start()
            outputs = list(await asyncio.wait_for(asyncio.gather(*tasks), 180))
            for stopper in stoppers:
                await asyncio.to_thread(stopper.join, 60)
                assert not stopper.is_alive()
            [stayed] = [e for e in registry.live() if e.role == Role.TOKEN]
            leaving["stayed_with"] = {s.service_id for s in stayed.shards}
            return outputs

        outputs = run_then_close(client, run())
    finally:
        for replica in started.values():
            if replica.worker.alive():
                replica.shutdown(drain_s=0)
    assert outputs == expected
    assert migrations == []  # what the leaving engine held finished on its own group
    name, shards = leaving["name"], leaving["shards"]
    order = registry.departed
    assert order.index(name) < min(order.index(s) for s in shards), order
    # The engine that stays kept its group whole throughout.
    assert leaving["stayed_with"] == groups[next(iter(set(groups) - {name}))]
