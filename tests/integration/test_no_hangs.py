"""No hangs: a peer that dies or stops never freezes the process that talks to it.

- A router that goes away mid-stream: its token engine keeps decoding for others. Its sends to the
  dead router's socket never block (they would, once ZeroMQ's queue of 1000 messages was full);
  when that queue is full the engine aborts the request and frees its KV.
- A shard that is stopped (SIGSTOP) mid-decode: its token engine gives the link up after
  `shard_reply_timeout_s` instead of waiting forever; the requests are re-run by the router and
  finish with the single-process engine's tokens.

Every wait has a deadline; real processes, sockets and UCX links.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from common.config import EngineConfig
from common.engine.core import LLMEngine
from common.mesh_options import MeshOptions
from common.protocol import SamplingSpec, TokenOutput
from common.roles import Role
from common.sampling_params import SamplingParams
from services.launch.local_mesh import LocalMesh, Topology
from tests.conftest import random_prompts
from tests.integration.mesh_helpers import assert_no_kv_held
from tests.integration.mesh_test_client import MeshTestClient
from tests.integration.test_self_healing import migrating_streams


@pytest.fixture
def mesh(tiny_model_path: Path) -> Iterator[LocalMesh]:
    topology = Topology(
        str(tiny_model_path), num_shards=2, options=MeshOptions(shard_reply_timeout_s=3.0)
    )
    mesh = LocalMesh.start(topology)
    yield mesh
    mesh.close()


def wait_for(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not {what} within {timeout_s} s"
        time.sleep(0.2)  # polling other processes' state


def reference(model_path: str, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model_path), with_tokenizer=False)
    return engine.generate(prompts, SamplingParams(max_tokens=num_tokens, temperature=0.0,
                                                   ignore_eos=True))  # fmt: skip


def test_a_dead_router_neither_freezes_its_engines_nor_leaks(mesh: LocalMesh) -> None:
    dead = MeshTestClient(mesh)
    long = SamplingSpec(max_tokens=2500, temperature=0.0, ignore_eos=True)
    dead.submit("orphan", random_prompts([20], 2048, seed=41)[0], long)
    dead.recv(timeout=60)  # decoding now
    dead.replies.close()  # the router is gone; its socket with it

    # The orphan's outputs fill the dead socket's queue (1000 messages); then the engine drops
    # the request. Before, its loop blocked on that send for good.
    wait_for(lambda: all(s.num_requests == 0 for s in mesh.stats()), 120, "idle")
    prompt = random_prompts([30], 2048, seed=42)[0]
    [expected] = reference(mesh.topology.model_path, [prompt], 12)
    alive = MeshTestClient(mesh)
    alive.submit("alive", prompt, SamplingSpec(max_tokens=12, temperature=0.0, ignore_eos=True))
    tokens: list[int] = []
    while not (out := alive.recv(timeout=60)).finish_reason:
        tokens += out.token_ids
    assert tokens + out.token_ids == expected
    wait_for(lambda: all(s.num_requests == 0 for s in mesh.stats()), 30, "idle")
    assert_no_kv_held(mesh)


def test_a_stopped_shard_does_not_hang_its_token_engine(mesh: LocalMesh) -> None:
    prompts = random_prompts([25, 60, 40], 2048, seed=43)
    expected = reference(mesh.topology.model_path, prompts, 40)
    shard = next(w for w in mesh.workers.values() if w.service_id == mesh.shards[1].service_id)
    try:
        streams = migrating_streams(
            mesh, prompts, 40, lambda: os.kill(shard.proc.pid, signal.SIGSTOP)
        )
        assert streams == expected
    finally:
        os.kill(shard.proc.pid, signal.SIGCONT)


def test_a_shard_that_stopped_briefly_is_linked_again_at_once(mesh: LocalMesh) -> None:
    """A shard stopped past the reply timeout, then continued: its token engine gives the
    group's links up (`ShardLinkFault`), decodes locally while it links the same shards again
    off its loop, and swaps the group back in once the shard answers (newest link wins: neither
    side hears of the old link's close). Its requests are re-run and finish with the
    single-process engine's tokens, and the next request's KV lands on both shards of the
    group."""
    prompts = random_prompts([25, 60], 2048, seed=44)
    expected = reference(mesh.topology.model_path, prompts, 40)
    shard = next(w for w in mesh.workers.values() if w.service_id == mesh.shards[1].service_id)

    def stop_past_the_reply_timeout() -> None:
        os.kill(shard.proc.pid, signal.SIGSTOP)
        threading.Timer(
            mesh.topology.options.shard_reply_timeout_s + 1.0,
            os.kill,
            (shard.proc.pid, signal.SIGCONT),
        ).start()

    try:
        assert migrating_streams(mesh, prompts, 40, stop_past_the_reply_timeout) == expected
    finally:
        time.sleep(mesh.topology.options.shard_reply_timeout_s + 1.5)  # the timer's SIGCONT went
        os.kill(shard.proc.pid, signal.SIGCONT)
    [token] = [s for s in mesh.stats() if s.role == "token"]
    assert token.num_group_relinks == 2  # dropped, then the same group again: never again
    client = MeshTestClient(mesh)
    client.submit("after", prompts[0], SamplingSpec(max_tokens=8, temperature=0.0))
    tokens, out = client.finish("after")
    assert (tokens, out.finish_reason) == (expected[0][:8], "length")
    landed = {s.service_id for s in mesh.stats() if s.role == "shard"
              for e in s.kv_events if e.req_id == "after" and e.what == "received"}  # fmt: skip
    assert landed == {s.service_id for s in mesh.shards}
    assert_no_kv_held(mesh)


def test_a_token_engine_links_to_shards_that_answer_late_at_start(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every shard stopped from just before its token engine starts, for 3.5 s: past the
    engine's first tries at a link, 1 s each (a mesh starting on a loaded machine: a live shard
    slow to get to its listener). The engine tries again instead of exiting, links the whole
    group, and decodes through it with the single-process engine's tokens; no relink, nothing
    left behind."""
    topology = Topology(
        str(tiny_model_path), num_shards=2, options=MeshOptions(shard_link_timeout_s=1.0)
    )
    spawn_model_peers = LocalMesh._spawn_model_peers
    stopped: list[int] = []

    def stop_the_shards_first(self: LocalMesh, *args: object) -> object:
        stopped.extend(w.proc.pid for w in self.workers.values() if w.cfg.role == Role.SHARD)
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        for pid in stopped:
            threading.Timer(3.5, os.kill, (pid, signal.SIGCONT)).start()
        return spawn_model_peers(self, *args)

    monkeypatch.setattr(LocalMesh, "_spawn_model_peers", stop_the_shards_first)
    mesh = LocalMesh.start(topology)
    try:
        assert len(stopped) == 2
        prompts = random_prompts([30], 2048, seed=45)
        expected = reference(mesh.topology.model_path, prompts, 12)
        client = MeshTestClient(mesh)
        client.submit(
            "late", prompts[0], SamplingSpec(max_tokens=12, temperature=0.0, ignore_eos=True)
        )
        tokens, out = client.finish("late")
        assert (tokens, out.finish_reason) == (expected[0], "length")
        [token] = [s for s in mesh.stats() if s.role == "token"]
        assert token.num_group_relinks == 0
        landed = {s.service_id for s in mesh.stats() if s.role == "shard"
                  for e in s.kv_events if e.req_id == "late" and e.what == "received"}  # fmt: skip
        assert landed == {s.service_id for s in mesh.shards}
        assert_no_kv_held(mesh)
    finally:
        mesh.close()


def test_more_requests_than_the_shards_hold_fail_only_before_they_decode(
    tiny_model_path: Path,
) -> None:
    """Six concurrent ~200-token prompts with 150 tokens each to generate, against one shard of 48
    blocks (768 tokens: room for two whole requests). Shards hold each request's tokens so far and
    grow them per step; what they refuse or cannot grow, the token engine preempts and recomputes
    (engine/admission.py), or, refused too often, ends before it decodes (a retryable error the
    router re-runs). One that decodes finishes with the single-process engine's tokens, never
    failing mid-stream for want of a block. Nothing is left behind."""
    blocks = MeshOptions(num_blocks=48, shard_num_blocks=48)
    mesh = LocalMesh.start(Topology(str(tiny_model_path), num_shards=1, options=blocks))
    try:
        prompts = random_prompts([200, 190, 210, 205, 195, 200], 2048, seed=44)
        expected = reference(mesh.topology.model_path, prompts, 150)
        client = MeshTestClient(mesh)
        spec = SamplingSpec(max_tokens=150, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            client.submit(f"r{i}", prompt, spec)
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        ends: dict[str, TokenOutput] = {}
        while len(ends) < len(prompts):
            out = client.recv(timeout=120)
            tokens[out.req_id] += out.token_ids
            if out.finish_reason or out.error:
                ends[out.req_id] = out
        finished = [r for r, out in ends.items() if out.finish_reason == "length"]
        assert len(finished) >= 2, ends
        for i in range(len(prompts)):
            req_id, out = f"r{i}", ends[f"r{i}"]
            if out.finish_reason == "length":
                assert tokens[req_id] == expected[i]
            else:  # refused before decoding: at most the prompt engine's first token
                assert out.retryable and len(tokens[req_id]) <= 1, out
        assert_no_kv_held(mesh)
        assert all(proc.is_alive() for proc in mesh.procs)
    finally:
        mesh.close()
