"""A token engine's per-layer shard round trips (`MeshModelRunner._attend_split`): every shard's
reply is read before anything is raised, a reply for another step or layer is a link fault (never
data), and so is a reply that does not come. The links here are in-memory stand-ins that answer
as told; the real UCX round trip is covered by the mesh tests."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from common.protocol import AttendBatch, AttendResult, ShardAddress
from common.scheduling.batching import Phase
from common.transport.ucx_channel import ChannelClosed
from services.engine.runner import (
    MeshModelRunner,
    ShardedRows,
    ShardLinkFault,
    StepPlan,
    StepResult,
)
from services.engine.shard_round_trip import ShardLost

N, HQ, HKV, D = 3, 4, 2, 8
# All the runner reads of its model here: query heads per KV head.
MODEL = SimpleNamespace(config=SimpleNamespace(num_queries_per_kv=HQ // HKV))


class ScriptedLink:
    """Answers each send with the reply its script says: 'ok', 'stale', 'error' or 'silent';
    'dead' (its shard died) and 'dead_on_send' raise ChannelClosed as a UCX channel does."""

    def __init__(self, script: str, value: float) -> None:
        self.script, self.value = script, value
        self.sent: list[AttendBatch] = []
        self.received = 0

    def send_async(self, header: AttendBatch, tensors: Any) -> None:
        if self.script == "dead_on_send":
            raise ChannelClosed("UCX peer gone")
        self.sent.append(header)

    def wait(self, handle: Any, timeout: float | None = None) -> None:
        pass

    def recv(self, out: Any = None, timeout: float | None = None) -> tuple[AttendResult, list]:
        self.received += 1
        if self.script == "dead":
            raise ChannelClosed("UCX peer gone")
        if self.script == "silent":
            raise TimeoutError
        if self.script == "misfit":  # as the channel says of a reply of other shapes or count
            raise ValueError("message has 2 tensors, 1 receive buffers given")
        header = self.sent[-1]
        out[0].fill_(self.value)
        step = header.step - 1 if self.script == "stale" else header.step
        error = "boom" if self.script == "error" else ""
        failed = ["b"] if self.script == "failed_b" else []
        return AttendResult(step, header.layer, error, failed), out


def attend(*scripts: str) -> tuple[torch.Tensor, StepResult]:
    links = [ScriptedLink(s, float(i + 1)) for i, s in enumerate(scripts)]
    shards = [ShardAddress(f"tcp://s{i}", i, i + 1) for i in range(len(links))]
    runner = MeshModelRunner(MODEL, None, None, None, shard_links=links, shards=shards)  # type: ignore[arg-type]
    rows = ShardedRows(step=7, req_ids=["a", "b", "c"], context_lens=[5, 6, 7])
    plan = StepPlan(
        Phase.DECODE, rows.req_ids, torch.zeros(N), torch.zeros(N), torch.zeros(0), [1] * N,
        torch.zeros(0, 1), torch.zeros(0), torch.arange(N), num_local=0, sharded=rows,
    )  # fmt: skip
    q, kv = torch.randn(N, HQ, D), torch.randn(N, HKV, D)
    result = StepResult(torch.empty(0))
    return runner._attend_sharded(0, q, kv, kv.clone(), plan, result), result


def test_each_shards_heads_land_in_place():
    out, result = attend("ok", "ok")
    group = HQ // HKV
    assert torch.all(out[:, :group] == 1.0) and torch.all(out[:, group:] == 2.0)
    assert result.failed == set()


def test_requests_a_shard_could_not_attend_for_are_named_not_raised():
    _, result = attend("ok", "failed_b")
    assert result.failed == {"b"}  # the engine ends b alone; a and c go on


@pytest.mark.parametrize(
    ("scripts", "raised"),
    [
        (("stale", "ok"), ShardLinkFault),
        (("ok", "silent"), ShardLinkFault),
        (("misfit", "ok"), ShardLinkFault),  # never data, never one step's error: the links go
        (("error", "ok"), RuntimeError),
        (("error", "stale"), ShardLinkFault),  # a link fault wins: the links go, not only a step
    ],
)
def test_every_reply_is_read_before_a_fault_is_raised(scripts, raised):
    with pytest.raises(raised) as info:
        attend(*scripts)
    if raised is RuntimeError:
        assert not isinstance(info.value, ShardLinkFault)


def attend_one_row(links: list[ScriptedLink]) -> None:
    """Step 3's layer 0 of one request over `links`, one KV head per shard."""
    shards = [ShardAddress(f"tcp://s{i}", i, i + 1) for i in range(len(links))]
    runner = MeshModelRunner(MODEL, None, None, None, shard_links=links, shards=shards)  # type: ignore[arg-type]
    rows = ShardedRows(step=3, req_ids=["a"], context_lens=[4])
    plan = StepPlan(Phase.DECODE, ["a"], torch.zeros(1), torch.zeros(1), torch.zeros(0), [1],
                    torch.zeros(0, 1), torch.zeros(0), torch.arange(1), num_local=0,
                    sharded=rows)  # fmt: skip
    kv = torch.randn(1, len(links), D)
    q = torch.randn(1, len(links) * HQ // HKV, D)
    runner._attend_sharded(0, q, kv, kv.clone(), plan, StepResult(kv))


def test_a_stale_reply_leaves_no_reply_queued():
    links = [ScriptedLink("stale", 1.0), ScriptedLink("ok", 2.0)]
    with pytest.raises(ShardLinkFault, match="step 2 layer 0 lane 0, expected step 3"):
        attend_one_row(links)
    assert [link.received for link in links] == [1, 1]  # the good shard's reply was read too


@pytest.mark.parametrize("dead", ["dead", "dead_on_send"])
def test_a_dead_shard_is_named_after_the_survivors_replies_are_read(dead):
    """A shard whose link closed (SIGKILLed) is named in `ShardLost`, raised only after every
    other shard's reply was read: the survivors' links stay in step, and keep their KV."""
    links = [ScriptedLink(dead, 1.0), ScriptedLink("ok", 2.0), ScriptedLink("ok", 3.0)]
    with pytest.raises(ShardLost) as info:
        attend_one_row(links)
    assert info.value.shards == {0}
    assert [link.received for link in links[1:]] == [1, 1]
