"""`ClusterScheduler` (services/router/cluster_scheduler.py): JSQ over live engines, on fabricated
load reports.

Decisions are checked against what Splitwise's JSQ must do: the prompt engine with the fewest
pending prompt tokens and the token engine with the fewest decode tokens, chosen together; what
the router just placed counts until the next report; engines that join are routable at once and
engines that leave never are.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from common.protocol import LoadReport, ShardAddress
from common.roles import Role
from services.mesh.registry import ServiceEntry
from services.router.cluster_scheduler import ClusterScheduler, NoEngines


def engine(service_id: str, role: str) -> ServiceEntry:
    return ServiceEntry(role=Role(role), service_id=service_id, state="ready",
                        command_endpoint=f"tcp://{service_id}")  # fmt: skip


def report(
    engine_id: str, pending: int = 0, decode: int = 0, free_blocks: int = 1000
) -> LoadReport:
    return LoadReport(engine_id, "", pending, decode, 0, 0, free_blocks)


PROMPTS = [engine("p0", "prompt"), engine("p1", "prompt")]
TOKENS = [engine("t0", "token"), engine("t1", "token")]


def scheduler(*entries: ServiceEntry) -> ClusterScheduler:
    p = ClusterScheduler(block_size=16)
    p.set_engines(list(entries))
    return p


def chosen(p: ClusterScheduler, prompt_len: int = 10) -> tuple[str, str]:
    prompt, token = p.choose(prompt_len)
    return prompt.service_id, token.service_id


def test_picks_the_shortest_prompt_and_token_queues_together() -> None:
    p = scheduler(*PROMPTS, *TOKENS)
    p.on_load(report("p0", pending=500))
    p.on_load(report("p1", pending=100))
    p.on_load(report("t0", decode=50))
    p.on_load(report("t1", decode=900))
    assert chosen(p) == ("p1", "t0")


def test_placements_count_until_the_next_report() -> None:
    p = scheduler(*PROMPTS, *TOKENS)
    for r in (report("p0", 100), report("p1", 120), report("t0", 0, 40), report("t1", 0, 60)):
        p.on_load(r)
    assert chosen(p, prompt_len=50) == ("p0", "t0")  # now p0: 150 pending, t0: 90 decode
    assert chosen(p, prompt_len=50) == ("p1", "t1")  # p1: 120 < 150, t1: 60 < 90
    p.on_load(report("p0", 0))  # a fresh report replaces the estimate
    assert chosen(p)[0] == "p0"


def test_a_new_engine_joins_at_once_and_a_gone_one_leaves() -> None:
    p = scheduler(PROMPTS[0], TOKENS[0])
    p.on_load(report("t0", decode=300))
    assert chosen(p) == ("p0", "t0")
    p.set_engines([PROMPTS[0], *TOKENS])  # t1 scaled in, no report yet: counts as idle
    assert chosen(p)[1] == "t1"
    p.set_engines([PROMPTS[0], TOKENS[1]])  # t0 left
    assert {chosen(p)[1] for _ in range(5)} == {"t1"}
    p.on_load(report("t0", decode=0))  # a late report of a gone engine changes nothing
    assert chosen(p)[1] == "t1"


def test_no_choice_without_a_prompt_and_a_token_engine() -> None:
    assert not scheduler(*PROMPTS).can_place()
    with pytest.raises(NoEngines):
        scheduler(*TOKENS).choose(10)
    assert scheduler(engine("m0", "mixed")).can_place()
    assert chosen(scheduler(engine("m0", "mixed"))) == ("m0", "m0")


def test_a_full_prompt_pool_borrows_a_token_engine() -> None:
    """Past the prompt-token threshold JSQ moves the least-loaded token engine into mixed."""
    p = scheduler(PROMPTS[0], *TOKENS)
    p.on_load(report("p0", pending=9000))  # over the 8192-token default threshold
    p.on_load(report("t0", decode=10))
    p.on_load(report("t1", decode=500))
    prompt, token = chosen(p)
    assert prompt == "t0"  # borrowed for prefill: the least loaded of the token pool
    # t0 is in the mixed pool now; the token pool (t1 alone) is not full, so it decodes there.
    assert token == "t1"


def test_free_kv_is_reported_in_tokens() -> None:
    p = scheduler(*PROMPTS, *TOKENS)
    p.on_load(report("t0", free_blocks=3))
    assert p.loads()["t0"].free_kv_tokens == 48


def test_a_token_engine_that_reports_a_broken_group_decodes_locally() -> None:
    # The registry still lists both shards (their entries age out in seconds); the engine's own
    # load report already says it lost them: place with local attention, not on a dead group.
    group = (ShardAddress("tcp://s0", 0, 1), ShardAddress("tcp://s1", 1, 2))
    token = replace(TOKENS[0], shards=group)
    shards = [shard("s0"), shard("s1")]
    p = scheduler(PROMPTS[0], token, *shards)
    assert p.choose(10)[1].shards == group  # no report yet: the registry's word
    whole = report("t0")
    whole.shard_endpoints = ["tcp://s0", "tcp://s1"]
    p.on_load(whole)
    assert p.choose(10)[1].shards == group
    broken = report("t0")
    broken.shard_endpoints = []
    p.on_load(broken)
    assert p.choose(10)[1].shards == ()
    assert token.shards == group  # the registry's entry itself is untouched
    p.on_load(whole)  # a stale report: the group looks whole again ...
    assert p.choose(10)[1].shards == group
    p.set_engines([PROMPTS[0], token, shards[0]])  # ... but s1 has left the registry
    assert p.choose(10)[1].shards == ()


def shard(service_id: str) -> ServiceEntry:
    return ServiceEntry(role=Role.SHARD, service_id=service_id, state="ready",
                        kv_endpoint=f"tcp://{service_id}")  # fmt: skip
