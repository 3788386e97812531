"""Request-level shard partitioning (Lamina Fig. 9a): the router puts each request's whole KV on
the shard of its token engine's group with the fewest KV tokens, and the token engine sends each
shard only its own requests' rows, all heads."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from common.protocol import AttendBatch, AttendResult, LoadReport, ShardAddress
from common.roles import Role
from common.scheduling.batching import Phase
from common.scheduling.shard_choice import ShardKvLoads, holds_whole_requests
from services.mesh.registry import ServiceEntry
from services.router.cluster_scheduler import ClusterScheduler

WHOLE = (ShardAddress("tcp://s0", 0, 2), ShardAddress("tcp://s1", 0, 2))
SPLIT = (ShardAddress("tcp://s0", 0, 1), ShardAddress("tcp://s1", 1, 2))


def test_a_group_holds_whole_requests_when_its_shards_hold_the_same_heads():
    assert holds_whole_requests(WHOLE)
    assert not holds_whole_requests(SPLIT)
    assert not holds_whole_requests(WHOLE[:1])  # one shard: both partitions are the same


def test_requests_go_where_the_fewest_kv_tokens_are_reported_plus_placed():
    loads = ShardKvLoads()
    group = ["tcp://s0", "tcp://s1"]
    assert loads.choose(group, 100) == 0  # a tie: the first
    assert [loads.choose(group, 30) for _ in range(4)] == [1, 1, 1, 1]  # s1: 0, 30, 60, 90
    assert loads.choose(group, 30) == 0  # s1 holds 120 now, s0 100
    loads.on_report(group, [10, 500])  # the engine's word replaces the estimate
    assert loads.choose(group, 1000) == 0 and loads.choose(group, 1) == 1


def test_the_router_sends_a_request_to_one_shard_of_a_whole_request_group():
    entries = [
        ServiceEntry(role=Role.PROMPT, service_id="p0", state="ready", command_endpoint="tcp://p0"),
        replace(ServiceEntry(role=Role.TOKEN, service_id="t0", state="ready",
                             command_endpoint="tcp://t0"), shards=WHOLE),
        *[ServiceEntry(role=Role.SHARD, service_id=f"s{i}", state="ready",
                       kv_endpoint=f"tcp://s{i}") for i in range(2)],
    ]  # fmt: skip
    p = ClusterScheduler(block_size=16)
    p.set_engines(entries)
    report = LoadReport("t0", None, 0, 0, 0, 0, 1000, shard_endpoints=["tcp://s0", "tcp://s1"],
                        shard_kv_tokens=[800, 100])  # fmt: skip
    p.on_load(report)
    assert p.choose(500)[1].shards == (WHOLE[1],)  # 100 < 800
    assert p.choose(500)[1].shards == (WHOLE[1],)  # 600 < 800
    assert p.choose(500)[1].shards == (WHOLE[0],)  # 1100 > 800
    split = replace(entries[1], shards=SPLIT)
    p.set_engines([entries[0], split, *entries[2:]])
    assert p.choose(10)[1].shards == SPLIT  # heads split: every shard, as before


class EchoLink:
    """Answers each layer with its rows' q, so each row's output says where it went."""

    def __init__(self) -> None:
        self.sent: list[tuple[AttendBatch, list[torch.Tensor]]] = []

    def send_async(self, header: AttendBatch, tensors: Any) -> None:
        self.sent.append((header, tensors))

    def wait(self, handle: Any, timeout: float | None = None) -> None:
        pass

    def recv(self, out: Any = None, timeout: float | None = None) -> tuple[AttendResult, list]:
        header, (q, _, _) = self.sent[-1]
        return AttendResult(header.step, header.layer), [q.float()]


def test_each_shard_gets_only_its_requests_rows_and_their_outputs_land_in_their_rows():
    from services.engine.runner import MeshModelRunner, ShardedRows, StepPlan, StepResult

    links = [EchoLink(), EchoLink(), EchoLink()]
    shards = [ShardAddress(f"tcp://s{i}", 0, 2) for i in range(3)]
    runner = MeshModelRunner(None, None, None, None, shard_links=links, shards=shards)  # type: ignore[arg-type]
    n = 3
    rows = ShardedRows(step=4, req_ids=["a", "b", "c"], context_lens=[5, 6, 7])
    rows.shard_rows = [[0, 2], [1], []]
    plan = StepPlan(
        Phase.DECODE, rows.req_ids, torch.zeros(n), torch.zeros(n), torch.zeros(0), [1] * n,
        torch.zeros(0, 1), torch.zeros(0), torch.arange(n), num_local=0, sharded=rows,
    )  # fmt: skip
    q = torch.arange(n, dtype=torch.float32).view(n, 1, 1).expand(n, 4, 8).contiguous()
    kv = torch.randn(n, 2, 8)
    out = runner._attend_sharded(0, q, kv, kv.clone(), plan, StepResult(torch.empty(0)))
    assert torch.equal(out, q)  # every row's output came back to its own row
    (h0, t0), (h1, _) = links[0].sent[0], links[1].sent[0]
    assert (h0.req_ids, h0.context_lens, h1.req_ids) == (["a", "c"], [5, 7], ["b"])
    assert t0[0].shape == (2, 4, 8) and t0[1].shape == (2, 2, 8)  # its rows, every head
    assert links[2].sent == []  # no rows: no message
