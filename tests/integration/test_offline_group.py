"""Seesaw's offline group: 2 worker processes over torch.distributed (gloo), a shared-memory KV
buffer, pipeline-parallel prefill and tensor-parallel decode. Greedy outputs equal the
single-process engine's, for every mode, including jobs that cross many stage transitions."""

from __future__ import annotations

import asyncio
import fcntl
import itertools
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from common.engine.core import LLMEngine
from common.sampling_params import SamplingParams
from services.offline.group import OfflineGroup, OfflineGroupError
from services.offline.options import MODES, OfflineOptions
from services.offline.service import LocalOffline, OfflineService
from services.router.batch_api import asgi_caller
from services.router.engine_client import InProcessEngineClient
from services.router.server import Router

PROMPTS = [[(7 * i + j) % 2000 + 5 for j in range(3 + i % 9)] for i in range(14)]
MAX_TOKENS = [4 + i % 7 for i in range(14)]


@pytest.fixture(scope="module")
def expected(tiny_model_path: Path) -> list[list[int]]:
    engine = LLMEngine.from_path(tiny_model_path, num_blocks=256)
    return [engine.generate([p], SamplingParams(temperature=0, max_tokens=m))[0]
            for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)]  # fmt: skip


@pytest.fixture(scope="module")
def group(tiny_model_path: Path) -> Iterator[OfflineGroup]:
    # A buffer of 4 and 3 decode slots: 14 requests cross the PP/TP boundary many times.
    with OfflineGroup(tiny_model_path, 2, num_buffer_slots=4, num_decode_slots=3,
                      max_len=64) as g:  # fmt: skip
        yield g


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_gives_the_single_process_greedy_tokens(
    group: OfflineGroup, expected: list[list[int]], mode: str
) -> None:
    outputs, stats = group.generate(PROMPTS, MAX_TOKENS, mode=mode)
    assert outputs == expected
    assert stats.num_tokens == sum(len(o) for o in expected)
    assert stats.num_prefills >= 4 and stats.num_decode_steps > 0
    if mode in ("seesaw", "prefill_first"):
        # PP prefill, TP decode: the small buffer forces several re-shards, and some requests
        # decode across several of them (their KV in TP slots while the group prefilled in PP).
        assert stats.num_transitions >= 3
        assert max(stats.transitions_crossed(i) for i in range(len(PROMPTS))) >= 2
    if mode == "seesaw":
        # Transitions only when the buffer filled or emptied: far fewer than prefill-first's.
        _, eager = group.generate(PROMPTS, MAX_TOKENS, mode="prefill_first")
        assert stats.num_transitions < eager.num_transitions


def test_a_stopped_job_keeps_the_requests_that_ended(
    group: OfflineGroup, expected: list[list[int]]
) -> None:
    """A cancel ends a job between steps: the requests that ended are whole and equal the
    single-process engine's; a cancel that comes before its job runs ends it before it starts."""
    steps = itertools.count()
    outputs, stats = group.generate(PROMPTS, MAX_TOKENS, stop=lambda: next(steps) >= 12)
    assert 0 < len(stats.finished) < len(PROMPTS)
    assert all(outputs[i] == expected[i] for i in stats.finished)
    service = OfflineService(group)
    service.cancel("job-1")
    assert service.generate(PROMPTS[:2], MAX_TOKENS[:2], "job-1") == [None, None]
    assert service.generate(PROMPTS[:2], MAX_TOKENS[:2], "job-1") == expected[:2]  # used up


def test_a_request_that_does_not_fit_is_refused_before_anything_runs(group: OfflineGroup) -> None:
    with pytest.raises(ValueError, match="does not fit"):
        group.generate([[5] * 60], [10])


def test_a_batch_of_greedy_completions_runs_as_one_offline_job(
    group: OfflineGroup, tiny_model_path: Path, tmp_path: Path
) -> None:
    """Seesaw behind the Batch API: a batch of greedy completions (or chats) goes to the group in
    one job, each line's response equal to the online API's for the same body (the router's own
    app, in process); a batch with one sampled line runs online, line by line."""
    engine = LLMEngine.from_path(tiny_model_path, num_blocks=256)
    service = OfflineService(group)
    router = Router(InProcessEngineClient(engine), tiny_model_path, "tiny",
                    batch_store=tmp_path / "b.sqlite", offline=LocalOffline(service))  # fmt: skip
    greedy = [{"model": "tiny", "prompt": f"offline line {i}", "max_tokens": 3 + i,
               "temperature": 0} for i in range(6)]  # fmt: skip
    sampled = {"model": "tiny", "prompt": "sampled", "max_tokens": 3}
    chats = [{"model": "tiny", "messages": [{"role": "user", "content": f"chat {i}"}],
              "max_tokens": 4 + i, "temperature": 0} for i in range(3)]  # fmt: skip
    assert router.batches is not None
    store, runner = router.batches.store, router.batches.runner

    def batch(bodies: list[dict[str, Any]], url: str = "/v1/completions") -> str:
        rows = [{"custom_id": f"r{i}", "method": "POST", "url": url, "body": b}
                for i, b in enumerate(bodies)]  # fmt: skip
        content = "\n".join(json.dumps(r) for r in rows).encode()
        file_id = store.create_file("batch", "in.jsonl", content)["id"]
        return str(store.create_batch(file_id, url, "24h", None)["id"])

    def output(batch_id: str) -> list[dict[str, Any]]:
        out = store.file_content(store.get_batch(batch_id)["output_file_id"])
        return [json.loads(x) for x in out.decode().splitlines()]

    async def run() -> tuple[list[Any], list[dict[str, Any]], list[Any], list[dict[str, Any]]]:
        offline_batch = batch(greedy)
        await runner.run_batch(offline_batch)
        assert runner.num_offline_lines == 6 and service.num_jobs == 1
        await runner.run_batch(batch([*greedy[:2], sampled]))
        assert runner.num_offline_lines == 6 and runner.num_lines_run == 9  # online, 3 lines
        chat_batch = batch(chats, "/v1/chat/completions")
        await runner.run_batch(chat_batch)
        assert runner.num_offline_lines == 9 and service.num_jobs == 2
        # Cancelled: the job ends at its next step; what finished is kept, nothing runs online.
        cancelled = batch(greedy)
        store.cancel(cancelled)
        await runner.run_batch(cancelled)
        got = store.get_batch(cancelled)
        assert got["status"] == "cancelled" and service.num_jobs == 3
        assert got["request_counts"]["completed"] == runner.num_offline_lines - 9
        assert runner.num_lines_run == runner.num_offline_lines + 3  # the 3 online lines above
        call = asgi_caller(router.app, None)
        online = [await call("/v1/completions", b) for b in greedy]
        online_chats = [await call("/v1/chat/completions", b) for b in chats]
        return online, output(offline_batch), online_chats, output(chat_batch)

    try:
        online, lines, online_chats, chat_lines = asyncio.run(run())
    finally:
        router.shutdown()
        router.client.shutdown()  # type: ignore[attr-defined]
    assert [x["custom_id"] for x in lines] == [f"r{i}" for i in range(6)]
    for (status, body, _), line in zip(online, lines, strict=True):
        offline = line["response"]["body"]
        assert status == 200 and offline["usage"] == body["usage"]
        assert offline["choices"][0]["text"] == body["choices"][0]["text"]
        assert offline["choices"][0]["finish_reason"] == body["choices"][0]["finish_reason"]
    for (status, body, _), line in zip(online_chats, chat_lines, strict=True):
        offline = line["response"]["body"]
        assert status == 200 and offline["object"] == "chat.completion"
        assert offline["usage"] == body["usage"]
        assert offline["choices"][0]["message"] == body["choices"][0]["message"]
        assert offline["choices"][0]["finish_reason"] == body["choices"][0]["finish_reason"]


def test_the_served_group_starts_with_its_first_job_and_stops_when_idle(
    tiny_model_path: Path, expected: list[list[int]]
) -> None:
    """The deployment's service (`OfflineService.start`) keeps no worker process while idle: its
    group (of one worker here: a start costs the suite a process) starts with the first job, whose
    outputs equal the single-process engine's, and stops `idle_stop_s` after it; the next job
    would start another the same way."""
    options = OfflineOptions(workers=1, buffer_slots=4, decode_slots=3, max_len=64)
    service = OfflineService.start(tiny_model_path, options)
    service.idle_stop_s = 1.0
    try:
        assert service.group is None and service.healthy() and service.max_len == 64
        assert service.generate(PROMPTS[:4], MAX_TOKENS[:4]) == expected[:4]
        group = service.group
        assert group is not None and service.num_starts == 1
        deadline = time.monotonic() + 30  # a hang guard: the timer fires after 1 s
        while service.group is not None:
            assert time.monotonic() < deadline, "the idle group was never stopped"
            time.sleep(0.1)
        assert not any(p.is_alive() for p in group.procs) and service.healthy()
    finally:
        service.close()
    assert service.group is None


def test_a_killed_worker_fails_the_job_instead_of_hanging(
    group: OfflineGroup, tiny_model_path: Path, tmp_path: Path
) -> None:
    """Last in this module: it breaks the module's group. The job fails (no hang), and a batch
    sent to the broken group runs through the online API instead, every line answered."""
    group.result_timeout_s = 30
    os.kill(group.procs[1].pid, signal.SIGKILL)  # type: ignore[arg-type]
    with pytest.raises(OfflineGroupError):
        group.generate([[5, 6, 7]], [3])
    engine = LLMEngine.from_path(tiny_model_path, num_blocks=64)
    broken = LocalOffline(OfflineService(group))
    router = Router(InProcessEngineClient(engine), tiny_model_path, "tiny",
                    batch_store=tmp_path / "b.sqlite", offline=broken)  # fmt: skip
    assert router.batches is not None
    store, runner = router.batches.store, router.batches.runner
    rows = [{"custom_id": f"k{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": "tiny", "prompt": f"k {i}", "max_tokens": 3, "temperature": 0}}
            for i in range(3)]  # fmt: skip
    file_id = store.create_file("batch", "k.jsonl",
                                "\n".join(json.dumps(r) for r in rows).encode())["id"]  # fmt: skip
    batch_id = store.create_batch(file_id, "/v1/completions", "24h", None)["id"]
    try:
        asyncio.run(runner.run_batch(batch_id))
    finally:
        router.shutdown()
        router.client.shutdown()  # type: ignore[attr-defined]
    counts = store.get_batch(batch_id)["request_counts"]
    assert counts == {"total": 3, "completed": 3, "failed": 0}
    assert runner.num_offline_lines == 0 and runner.num_lines_run == 3


def test_a_first_job_waits_out_its_workers_slow_load_not_the_result_timeout(
    tiny_model_path: Path, expected: list[list[int]], tmp_path: Path
) -> None:
    """A group starts with its first job, so that job's first result waits for every worker's
    model load: a load slower than `result_timeout_s` (here held on the node's weight-cache lock,
    as behind another replica writing the file) is start-up, not a worker that stopped
    answering. The workers then map the cached weights and give the single-process tokens."""
    from common.model.loader import load_model

    load_model(tiny_model_path, weight_cache=tmp_path)  # the node's cache file and its lock
    (lock_path,) = tmp_path.glob("*.lock")
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # every worker's load waits here
        group = OfflineGroup(tiny_model_path, 2, num_buffer_slots=4, num_decode_slots=3,
                             max_len=64, result_timeout_s=3.0, weight_cache=tmp_path)  # fmt: skip
        try:
            outputs: list[Any] = []
            job = threading.Thread(
                target=lambda: outputs.append(group.generate(PROMPTS, MAX_TOKENS))
            )
            job.start()
            time.sleep(5.0)  # past result_timeout_s (and its 1-s polls), nothing loaded
            assert group.loading == {0, 1}
            fcntl.flock(lock, fcntl.LOCK_UN)
            job.join(timeout=300)
            assert outputs and outputs[0][0] == expected
            assert not group.loading
        finally:
            group.close()


def test_a_group_whose_start_fails_leaves_no_shared_buffer(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start that fails after the shared KV buffer was made (here: no fork server to be had)
    raises, and the buffer's segment is gone with it, not left in /dev/shm."""
    from multiprocessing import shared_memory

    made: list[str] = []
    real = shared_memory.SharedMemory

    def recording(*args: Any, **kwargs: Any) -> Any:
        shm = real(*args, **kwargs)
        made.append(shm.name)
        return shm

    def no_fork_server(_method: str) -> Any:
        raise OSError("no fork server")

    monkeypatch.setattr("services.offline.group.shared_memory.SharedMemory", recording)
    monkeypatch.setattr("services.offline.group.multiprocessing.get_context", no_fork_server)
    with pytest.raises(OSError, match="no fork server"):
        OfflineGroup(tiny_model_path, 2, num_buffer_slots=4, num_decode_slots=3, max_len=64)
    assert len(made) == 1
    with pytest.raises(FileNotFoundError):
        real(name=made[0])


def _join_and_sum(rank: int, k: int, rendezvous: Any, timeout_s: float, out: Any) -> None:
    """A worker's join (`join_group`), then an all-reduce of its rank: proof the group is one."""
    import queue

    import torch
    import torch.distributed as dist

    from services.offline.worker import join_group

    try:
        join_group(rank, k, rendezvous, timeout_s)
        total = torch.tensor([float(rank)])
        dist.all_reduce(total)
        out.put((rank, dist.get_world_size(), float(total)))
        dist.destroy_process_group()
    except queue.Empty:
        out.put((rank, "no port", None))


def test_workers_join_on_the_port_rank_0_bound_and_wait_no_longer_than_told() -> None:
    """Rank 0 binds its store's port itself (no port picked free and bound later, which another
    process could take in between) and hands it to its peers: three workers form one group. A
    peer whose rank 0 never comes gives up after its timeout instead of waiting forever."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    rendezvous, out = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_join_and_sum, args=(r, 3, rendezvous, 60.0, out))
             for r in (2, 1, 0)]  # fmt: skip
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert results == [(0, 3, 3.0), (1, 3, 3.0), (2, 3, 3.0)]

    nobody = ctx.Queue()  # kept alive: the child unpickles it after its start
    alone = ctx.Process(target=_join_and_sum, args=(1, 2, nobody, 0.5, out))
    alone.start()
    assert out.get(timeout=120) == (1, "no port", None)
    alone.join(30)
