"""`ClusterScheduler` (services/router/cluster_scheduler.py): JSQ over live engines, on fabricated
load reports.

Decisions are checked against what Splitwise's JSQ must do: the prompt engine with the fewest
pending prompt tokens and the token engine with the fewest decode tokens, chosen together; what
the router just placed counts until the next report; engines that join are routable at once and
engines that leave never are.
"""

from __future__ import annotations

import time
from dataclasses import replace

import msgspec
import pytest
import zmq

from common.protocol import LoadReport, ShardAddress
from common.roles import Role
from common.transport.zmq_sockets import TypedSocket
from services.mesh.registry import ServiceEntry
from services.router import cluster_scheduler
from services.router.cluster_scheduler import PLACEMENT_TTL_S, ClusterScheduler, NoEngines


def engine(service_id: str, role: str) -> ServiceEntry:
    return ServiceEntry(role=Role(role), service_id=service_id, state="ready",
                        command_endpoint=f"tcp://{service_id}")  # fmt: skip


ROUTER = "tcp://router:1"  # the scheduler's router: its reply endpoint


def report(
    engine_id: str, pending: int = 0, decode: int = 0, free_blocks: int = 1000, received: int = 0
) -> LoadReport:
    """A report made after the engine had received `received` of this router's requests."""
    return LoadReport(engine_id, None, pending, decode, 0, 0, free_blocks,
                      received_requests={ROUTER: received})  # fmt: skip


PROMPTS = [engine("p0", "prompt"), engine("p1", "prompt")]
TOKENS = [engine("t0", "token"), engine("t1", "token")]


def scheduler(*entries: ServiceEntry) -> ClusterScheduler:
    p = ClusterScheduler(block_size=16, reply_endpoint=ROUTER)
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
    p.on_load(report("p0", 0, received=1))  # a fresh report that holds it replaces the estimate
    assert chosen(p)[0] == "p0"


def test_a_report_made_before_a_placement_arrived_does_not_erase_it() -> None:
    p = scheduler(*PROMPTS, TOKENS[0])
    p.on_load(report("p0", 100, received=0))
    p.on_load(report("p1", 120, received=0))
    assert chosen(p, prompt_len=50) == ("p0", "t0")  # 1st on p0: 150 pending
    assert chosen(p, prompt_len=50) == ("p1", "t0")  # 1st on p1: 170
    assert chosen(p, prompt_len=50) == ("p0", "t0")  # 2nd on p0: 200
    # p0's report was made when it had read only its 1st (prefilling: 100 + 50 pending, its 50
    # tokens held for t0).
    held = {"tcp://t0": 50}
    p.on_load(msgspec.structs.replace(report("p0", 150, received=1), handoff_tokens=held))
    assert p.loads()["p0"].pending_prompt_tokens == 200  # the 2nd still counts, once
    assert p.loads()["t0"].decode_tokens == 150  # all three, held for it by p0 and p1
    # Another router's requests are not this one's: its count confirms none of ours.
    other = LoadReport("p1", None, 120, 0, 0, 0, 1000, received_requests={"tcp://other:2": 9})
    p.on_load(other)
    assert p.loads()["p1"].pending_prompt_tokens == 170
    assert chosen(p, prompt_len=50)[0] == "p1"  # 170 < 200
    p.on_load(report("p0", 200, received=2))
    p.on_load(report("p1", 220, received=2))
    assert [p.loads()[e].pending_prompt_tokens for e in ("p0", "p1")] == [200, 220]


def test_a_placement_no_report_ever_holds_stops_counting(monkeypatch: pytest.MonkeyPatch) -> None:
    p = scheduler(PROMPTS[0], TOKENS[0])
    chosen(p, prompt_len=64)  # sent, never received (say its send failed)
    p.on_load(report("p0", 0))
    assert p.loads()["p0"].pending_prompt_tokens == 64
    later = time.monotonic() + PLACEMENT_TTL_S + 1
    monkeypatch.setattr(cluster_scheduler.time, "monotonic", lambda: later)
    p.on_load(report("p0", 0))
    assert p.loads()["p0"].pending_prompt_tokens == 0


def test_placements_not_yet_reported_leave_with_their_engines() -> None:
    p = scheduler(*PROMPTS, *TOKENS)
    for r in (report("p0", 0), report("p1", 10), report("t0", decode=0), report("t1", decode=5)):
        p.on_load(r)
    assert chosen(p, prompt_len=40) == ("p0", "t0")
    assert chosen(p, prompt_len=40) == ("p1", "t1")
    # t0 killed: what p0 holds for it lands nowhere, also after p0's next (older) report.
    p.set_engines([*PROMPTS, TOKENS[1]])
    p.on_load(report("p0", 0))
    assert p.loads()["p0"].pending_prompt_tokens == 0
    assert p.loads()["t1"].decode_tokens == 45  # its own 5 and p1's unreported 40
    # p1 killed: its unreported placement goes with it; t1 is back to its own report.
    p.set_engines([PROMPTS[0], TOKENS[1]])
    assert p.loads()["t1"].decode_tokens == 5
    # p1 back under its id (a registry that forgot it briefly): the router counts afresh while
    # p1 goes on counting, so its reports confirm the new placements at once (the old way).
    p.set_engines([*PROMPTS, TOKENS[1]])
    p.on_load(report("p1", 0))
    assert p.loads()["p1"].pending_prompt_tokens == 0
    assert [chosen(p, prompt_len=40)[0] for _ in range(2)] == ["p0", "p1"]  # ties: lowest id
    p.on_load(report("p1", 40, received=2))  # its 2nd from this router, the router's 1st
    assert p.loads()["p1"].pending_prompt_tokens == 40


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


def handoffs(engine_id: str, **held: int) -> LoadReport:
    """A prompt engine's report holding `held` decode tokens for token engines (by service id)."""
    return msgspec.structs.replace(
        report(engine_id), handoff_tokens={f"tcp://{t}": n for t, n in held.items()}
    )


def test_a_token_engines_report_made_before_its_hand_offs_does_not_erase_them() -> None:
    p = scheduler(PROMPTS[0], *TOKENS)
    first = chosen(p, prompt_len=100)[1]
    # The first request is still prefilling: the token engine's next report does not hold it.
    p.on_load(report(first, decode=0))
    assert chosen(p, prompt_len=100)[1] != first  # it still counts where it will decode
    assert p.loads()[first].decode_tokens == 100


def test_prompt_engines_say_what_they_hold_for_each_token_engine() -> None:
    p = scheduler(*PROMPTS, *TOKENS)
    p.on_load(report("t0", decode=300))
    p.on_load(report("t1", decode=100))
    p.on_load(handoffs("p0", t1=250))  # t1's next 250 tokens are prefilling on p0
    p.on_load(handoffs("p1", t1=50, nowhere=10_000))  # an endpoint no engine has: nothing lands
    assert p.loads()["t1"].decode_tokens == 400 and p.loads()["t0"].decode_tokens == 300
    assert chosen(p)[1] == "t0"
    # Handed off: p0 holds nothing now, and t1 reports the request as its own (no double count).
    p.on_load(handoffs("p0"))
    p.on_load(report("t1", decode=350))
    assert p.loads()["t1"].decode_tokens == 400


def test_what_a_gone_prompt_engine_held_leaves_with_it() -> None:
    p = scheduler(*PROMPTS, *TOKENS)
    p.on_load(handoffs("p0", t0=1000))
    assert chosen(p)[1] == "t1"
    p.set_engines([PROMPTS[1], *TOKENS])  # p0 died: its prompts will be re-run elsewhere
    assert p.loads()["t0"].decode_tokens == 0


def test_what_prompt_engines_held_for_a_gone_token_engine_lands_nowhere() -> None:
    p = scheduler(*PROMPTS, *TOKENS)
    p.on_load(handoffs("p0", t0=1000, t1=5))
    p.set_engines([*PROMPTS, TOKENS[1]])  # t0 killed mid-request: its hand-offs will fail over
    assert set(p.loads()) == {"p0", "p1", "t1"} and p.loads()["t1"].decode_tokens == 5
    p.on_load(handoffs("p0", t0=1000, t1=5))  # a report made before p0 heard of it
    assert p.loads()["t1"].decode_tokens == 5 and {chosen(p)[1] for _ in range(3)} == {"t1"}


def test_a_mixed_engine_decoding_its_own_prompt_counts_it_as_its_own() -> None:
    p = scheduler(engine("m0", "mixed"))
    assert chosen(p, prompt_len=64) == ("m0", "m0")
    assert p.loads()["m0"].decode_tokens == 64
    p.on_load(report("m0", pending=64, received=1))  # its own: pending now, decoding later
    assert p.loads()["m0"].decode_tokens == 0


@pytest.mark.parametrize(
    "wrong",
    [
        {"pending_prompt_tokens": -1},
        {"running_decode_tokens": -10_000},
        {"free_kv_blocks": -1},
        {"handoff_tokens": {"tcp://t0": -50}},
        {"received_requests": {ROUTER: -1}},
    ],
)
def test_a_report_with_a_negative_count_is_dropped_by_the_socket(wrong: dict) -> None:
    """An engine saying it holds less than nothing would win every JSQ choice: such a report
    fails decoding, and the router's socket drops it (logged) and takes the next one."""
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("inproc://reports")
    push.connect("inproc://reports")
    reports: TypedSocket[LoadReport] = TypedSocket(pull, LoadReport)
    try:
        push.send(msgspec.msgpack.encode(msgspec.structs.replace(report("t0"), **wrong)))
        push.send(msgspec.msgpack.encode(report("t1", decode=7)))
        got = reports.recv(timeout_s=5.0)
        assert got is not None and got[1].engine_id == "t1" and got[1].running_decode_tokens == 7
    finally:
        push.close(0)
        reports.close()
        ctx.term()
