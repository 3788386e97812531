"""A token engine's shard links are made off its decode loop (`services/engine/shard_linker.py`).

- A shard that is stopped (SIGSTOP) when the engine is told to link to it holds no stream: the
  connect waits on a thread of its own while the engine's local requests decode on, and the
  group is swapped in once the shard answers (after SIGCONT).
- A link that breaks while its shard stays registered (its TCP connections reset) is made again:
  the requests on it end retryably, and later requests decode against the group.

A real `LocalMesh` (processes, ZeroMQ, UCX), greedy tokens against the single-process engine.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from common.mesh_options import MeshOptions
from common.protocol import LinkShards, SamplingSpec, ShardAddress
from services.launch.local_mesh import LocalMesh, Topology
from tests.conftest import random_prompts
from tests.integration.mesh_helpers import assert_no_kv_held
from tests.integration.mesh_test_client import MeshTestClient
from tests.integration.test_no_hangs import reference, wait_for

LINK_TIMEOUT_S = 3.0  # one try at a link: how long a connect to a stopped shard waits


@pytest.fixture
def mesh(tiny_model_path: Path) -> Iterator[LocalMesh]:
    options = MeshOptions(shard_link_timeout_s=LINK_TIMEOUT_S, shard_reply_timeout_s=3.0)
    mesh = LocalMesh.start(Topology(str(tiny_model_path), num_shards=2, options=options))
    yield mesh
    mesh.close()


def relinks(mesh: LocalMesh) -> int:
    [token] = [s for s in mesh.stats() if s.role == "token"]
    return token.num_group_relinks


def linked(mesh: LocalMesh) -> bool:
    """The token engine decodes against a shard group now (its stats break a step down only
    then)."""
    [token] = [s for s in mesh.stats() if s.role == "token"]
    return token.decode_breakdown is not None


def group_of(mesh: LocalMesh) -> list[ShardAddress]:
    return list(mesh.token[0].shards)


def test_a_stopped_shard_named_in_a_relink_does_not_stall_other_streams(mesh: LocalMesh) -> None:
    client = MeshTestClient(mesh)
    token = mesh.token[0]
    group = group_of(mesh)
    push = client.push.get(token.command_endpoint)
    push.send(LinkShards([]))  # local attention: the next group needs new links
    wait_for(lambda: relinks(mesh) == 1, 30, "the group dropped")
    local = dataclasses.replace(token, shards=[])  # these requests keep their KV on the engine
    prompts = random_prompts([20, 33], 2048, seed=61)
    long = SamplingSpec(max_tokens=4000, temperature=0.0, ignore_eos=True)
    stopped = mesh.workers[group[1].service_id].proc.pid
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    os.kill(stopped, signal.SIGSTOP)
    try:
        for (req_id, _), prompt in zip(tokens.items(), prompts, strict=True):
            client.submit(req_id, prompt, long, token_engine=local)

        def decode_until(end: float) -> float:
            """Receive until `end` (or until each stream has 10 tokens, end=0); the longest gap
            between two tokens of one stream."""
            last: dict[str, float] = {}
            longest = 0.0
            while (end and time.monotonic() < end) or (
                not end and min(map(len, tokens.values())) < 10
            ):
                out = client.recv(timeout=30)
                assert not out.error, out.error
                now = time.monotonic()
                if out.req_id in last:
                    longest = max(longest, now - last[out.req_id])
                last[out.req_id] = now
                tokens[out.req_id] += out.token_ids
            return longest

        decode_until(0)  # both decoding
        baseline = decode_until(time.monotonic() + 1.0)
        push.send(LinkShards(group))  # one of its shards is stopped: its connect waits
        during = decode_until(time.monotonic() + LINK_TIMEOUT_S + 1.0)
        # Before, the loop waited out the connect (LINK_TIMEOUT_S) with every stream stopped.
        assert during < baseline + 1.0, (during, baseline)
        for req_id in tokens:
            client.abort(req_id)
    finally:
        os.kill(stopped, signal.SIGCONT)
    expected = reference(mesh.topology.model_path, prompts, 32)
    for got, want in zip(tokens.values(), expected, strict=True):
        assert got[:32] == want
    # The shard answers now: the connect tried again is swapped in, the whole group.
    wait_for(lambda: relinks(mesh) == 2, 60, "the group linked once the shard answered")
    assert_no_kv_held(mesh)


def cut_connections(a: int, b: int) -> int:
    """Abort every TCP connection between processes `a` and `b` (`ss -K`: the kernel resets
    them, as a network fault would); how many it cut."""
    if shutil.which("ss") is None:
        return 0
    ports_b = {c.laddr.port for c in psutil.Process(b).net_connections("tcp")}
    cut = 0
    for conn in psutil.Process(a).net_connections("tcp"):
        if conn.raddr and conn.raddr.port in ports_b and conn.status == psutil.CONN_ESTABLISHED:
            filters = ["sport", "=", f":{conn.laddr.port}", "dport", "=", f":{conn.raddr.port}"]
            done = subprocess.run(["ss", "-K", *filters], capture_output=True, check=False)
            cut += done.returncode == 0
    return cut


def test_a_link_broken_while_its_shard_stays_registered_is_made_again(
    mesh: LocalMesh,
) -> None:
    """The token engine's TCP connections to one shard are reset (the shard runs on, still
    registered): the request decoding against it is rebuilt onto the relinked shard or ends
    retryably, the engine links the group again off its loop, and the next request decodes
    against the group. Before, the engine
    dropped the group on the broken link and decoded locally for good (nothing relinked it: no
    membership change)."""
    client = MeshTestClient(mesh)
    group = group_of(mesh)
    prompt = random_prompts([27], 2048, seed=62)[0]
    [expected] = reference(mesh.topology.model_path, [prompt], 40)
    token_pid = mesh.workers[mesh.token[0].service_id].proc.pid
    shard_pid = mesh.workers[group[1].service_id].proc.pid
    greedy = SamplingSpec(max_tokens=40, temperature=0.0, ignore_eos=True)
    before = relinks(mesh)  # the module's other tests relink too
    client.submit("on-the-broken-link", prompt, greedy)
    out = client.recv(timeout=60)
    if not cut_connections(token_pid, shard_pid):
        pytest.skip("cannot reset TCP connections here (`ss -K`, with CAP_NET_ADMIN)")
    pieces = {out.index: out.token_ids}
    while not (out.error or out.finish_reason):
        out = client.recv(timeout=60)
        pieces[out.index] = out.token_ids
    tokens = [t for _, ids in sorted(pieces.items()) for t in ids]
    # Its step found the link broken: its lost heads were rebuilt onto the relinked shard (its
    # output unchanged), or it ended retryably (for the router to re-run).
    assert (out.error and out.retryable) or tokens == expected, out
    wait_for(lambda: relinks(mesh) >= before + 2 and linked(mesh), 60,
             "the group linked again (dropped, then back)")  # fmt: skip

    def reports_its_group() -> bool:  # the placement reads the engine's reports, not its state
        client.refresh()
        report = client.last_reports.get(mesh.token[0].service_id)
        return report is not None and len(report.shard_endpoints) == len(group)

    wait_for(reports_its_group, 30, "the token engine reporting its group whole again")
    short = SamplingSpec(max_tokens=12, temperature=0.0, ignore_eos=True)
    client.submit("after", prompt, short)
    tokens, last = client.finish("after")
    assert (tokens, last.finish_reason) == (expected[:12], "length")

    def landed() -> set[str]:
        return {s.service_id for s in mesh.stats() if s.role == "shard"
                for e in s.kv_events if e.req_id == "after" and e.what == "received"}  # fmt: skip

    # Decoded against the group, not locally (each shard's stats say so once it answers them).
    wait_for(lambda: landed() == {s.service_id for s in group}, 30, "the KV landed on the group")
    assert_no_kv_held(mesh)
