"""When a handed-off request may start decoding on a token engine (FCFS, KV in place first)."""

from __future__ import annotations

from common.block_manager import BlockManager
from common.config import SchedulerConfig
from common.protocol import DecodeHandoff, SamplingSpec, ShardAddress
from common.scheduling.batching import EngineScheduler, Sequence
from services.engine.admission import MAX_RECOMPUTES, RECOMPUTE_BACKOFF_S, DecodeAdmission

BLOCK = 16
SHARDS = [ShardAddress("tcp://shard-0", 0, 1), ShardAddress("tcp://shard-1", 1, 2)]


def handoff(req_id: str, tokens: int, max_tokens: int, sharded: bool) -> DecodeHandoff:
    return DecodeHandoff(
        req_id, list(range(tokens)), tokens - 1, SamplingSpec(max_tokens=max_tokens),
        "tcp://router", num_kv_layers=4, shards=SHARDS if sharded else [],
    )  # fmt: skip


def nothing_landed(req_id: str) -> bool:
    return False


def local_scheduler(num_blocks: int = 64) -> EngineScheduler:
    return EngineScheduler(BlockManager(num_blocks, BLOCK), SchedulerConfig())


def test_sharded_requests_start_at_once_and_the_count_holds_their_tokens_so_far():
    """A sharded hand-off never waits (its KV is on the shards already): it starts at once and
    the group's count holds its tokens so far, not its whole length, even past capacity (the
    next step's `fit_growth` then preempts)."""
    admission = DecodeAdmission(shard_num_blocks=4, block_size=BLOCK)  # 64 tokens
    admission.add(handoff("a", tokens=20, max_tokens=200, sharded=True))  # 2 blocks
    admission.add(handoff("b", tokens=10, max_tokens=200, sharded=True))  # 1 block
    admission.add(handoff("c", tokens=17, max_tokens=200, sharded=True))  # 2 blocks: 5 > 4
    assert admission.admit(local_scheduler(), nothing_landed) == ["a", "b", "c"]
    assert not admission.waiting
    assert admission.shard_blocks.num_used_blocks == 5 and admission.free_shard_blocks() == 0
    seq = admission.sharded[0]
    assert (seq.num_tokens, seq.num_computed) == (20, 19)  # its last token is decoded next
    assert admission.fit_growth(now=1.0) == ["c"]  # the youngest gives way
    assert admission.shard_blocks.num_used_blocks == 3
    admission.remove("a")  # finished
    assert admission.free_shard_blocks() == 3


def test_local_requests_wait_for_every_layer_of_their_kv():
    admission = DecodeAdmission(shard_num_blocks=0, block_size=BLOCK)
    local = local_scheduler()
    local.blocks.allocate("a", 30)  # the engine writes landed KV into its own blocks
    admission.add(handoff("a", tokens=30, max_tokens=8, sharded=False))
    landed: set[str] = set()
    assert admission.admit(local, landed.__contains__) == [] and not local.running
    landed.add("a")  # its last layer landed
    assert admission.admit(local, landed.__contains__) == ["a"]
    assert [s.req_id for s in local.running] == ["a"] and not admission.sharded


def test_remove_forgets_a_request_wherever_it_is():
    admission = DecodeAdmission(shard_num_blocks=8, block_size=BLOCK)
    admission.add(handoff("s", tokens=16, max_tokens=16, sharded=True))
    admission.admit(local_scheduler(), nothing_landed)
    admission.add(handoff("w", tokens=4, max_tokens=4, sharded=False))
    assert admission.waiting_for("w") is not None and admission.waiting_for("s") is None
    assert admission.is_decoding_here("s") and admission.is_decoding_here("w")
    assert not admission.is_decoding_here("x")
    admission.remove("s")
    admission.remove("w")
    assert not admission.sharded and not admission.waiting
    assert admission.shard_blocks.num_used_blocks == 0
    assert admission.waiting_for("w") is None


def test_growth_takes_a_block_when_the_last_one_fills():
    admission = DecodeAdmission(shard_num_blocks=2, block_size=BLOCK)
    admission.add(handoff("a", tokens=16, max_tokens=16, sharded=True))
    admission.admit(local_scheduler(), nothing_landed)
    assert admission.shard_blocks.num_used_blocks == 1
    admission.sharded[0].num_tokens += 1  # the 17th token's KV is written by the next step
    assert admission.fit_growth(now=0.0) == []
    assert admission.shard_blocks.num_used_blocks == 2


def test_pulled_requests_wait_for_every_shard_of_the_group_and_only_for_them():
    """`kv_transfer: pull`: a sharded hand-off joins decode steps once every shard of the group
    said its KV landed, so no step names a request a shard still lacks (none waits at layer 0);
    news may come before the hand-off. A sharded one still waiting does not hold up the others,
    and one that never lands is stalled after its bound."""
    admission = DecodeAdmission(shard_num_blocks=64, block_size=BLOCK, await_landing=True)
    admission.note_landed("tcp://shard-1", ["b"])  # before its hand-off
    admission.add(handoff("a", tokens=20, max_tokens=8, sharded=True), now=0.0)
    admission.add(handoff("b", tokens=20, max_tokens=8, sharded=True), now=0.0)
    assert admission.awaiting_landing()
    assert admission.admit(local_scheduler(), nothing_landed) == []
    admission.note_landed("tcp://shard-0", ["b", "a"])
    assert admission.admit(local_scheduler(), nothing_landed) == ["b"]  # a lacks shard-1's
    assert [h.req_id for h in admission.stalled(31.0, 30.0, nothing_landed)] == ["a"]
    admission.note_landed("tcp://shard-1", ["a"])
    assert admission.admit(local_scheduler(), nothing_landed) == ["a"]
    assert not admission.awaiting_landing()
    assert [s.req_id for s in admission.sharded] == ["b", "a"]


def test_pushed_requests_ignore_landing_news():
    admission = DecodeAdmission(shard_num_blocks=64, block_size=BLOCK)
    admission.add(handoff("a", tokens=20, max_tokens=8, sharded=True))
    assert not admission.awaiting_landing()
    assert admission.admit(local_scheduler(), nothing_landed) == ["a"]


def whole_len(lengths: dict[str, int]):
    return lambda req_id: lengths.get(req_id, 0)


def landed_local(local: EngineScheduler, req_id: str, tokens: int, max_tokens: int):
    """A local hand-off whose KV (`tokens - 1`: all but its first token) landed in `local`."""
    local.blocks.allocate(req_id, tokens - 1)
    return handoff(req_id, tokens=tokens, max_tokens=max_tokens, sharded=False)


def test_a_local_hand_off_starts_only_when_its_whole_length_fits():
    """Its whole length beside the growth the running ones may still take: a token engine never
    preempts its hand-offs for want of a block, and no step of it runs out of one."""
    local = local_scheduler(num_blocks=8)  # 128 tokens
    lengths = {"a": 70, "b": 50}  # prompt + max_tokens: 5 and 4 blocks
    admission = DecodeAdmission(shard_num_blocks=0, block_size=BLOCK)
    admission.add(landed_local(local, "a", tokens=31, max_tokens=40))  # 2 blocks landed
    admission.add(landed_local(local, "b", tokens=31, max_tokens=20))  # 2 blocks landed
    assert admission.admit(local, lambda r: True, whole_len(lengths)) == ["a"]  # 3 more of 4
    assert local.blocks_to_grow(whole_len(lengths)) == 3
    # b needs 2 more blocks; a may still take 3 of the 4 free: b waits, room is coming.
    assert admission.admit(local, lambda r: True, whole_len(lengths)) == []
    assert admission.unfittable(local, lambda r: True, whole_len(lengths), room_coming=True) == []
    local.remove("a")  # finished: its blocks and its growth come back
    assert admission.admit(local, lambda r: True, whole_len(lengths)) == ["b"]


def test_without_room_coming_the_youngest_gives_way_then_the_head_alone():
    local = local_scheduler(num_blocks=8)
    lengths = {r: 70 for r in "abcd"}  # 5 blocks each; 4 x 2 landed fill the cache
    admission = DecodeAdmission(shard_num_blocks=0, block_size=BLOCK)
    for req_id in "abcd":
        admission.add(landed_local(local, req_id, tokens=31, max_tokens=40))
    assert admission.admit(local, lambda r: True, whole_len(lengths)) == []
    refuse = admission.unfittable(local, lambda r: True, whole_len(lengths), room_coming=False)
    assert [h.req_id for h in refuse] == ["d"]  # its blocks may be what the head lacks
    assert admission.unfittable(local, lambda r: True, whole_len(lengths), room_coming=True) == []
    lengths["a"] = 16 * 9  # longer than the whole cache: it never fits, refused at once
    refuse = admission.unfittable(local, lambda r: True, whole_len(lengths), room_coming=True)
    assert [h.req_id for h in refuse] == ["a"]


def test_a_head_without_room_is_starved_after_its_bound():
    local = local_scheduler(num_blocks=4)
    lengths = {"run": 48, "a": 40}
    local.blocks.allocate("run", 20)
    local.add_running(Sequence("run", 21))  # may grow to 3 blocks: 1 more
    admission = DecodeAdmission(shard_num_blocks=0, block_size=BLOCK)
    admission.add(landed_local(local, "a", tokens=17, max_tokens=23), now=0.0)  # 1 + 2 more
    assert admission.admit(local, lambda r: True, whole_len(lengths)) == []
    assert admission.starved(30.0, 30.0, local, lambda r: True, whole_len(lengths)) == []
    starved = admission.starved(31.0, 30.0, local, lambda r: True, whole_len(lengths))
    assert [h.req_id for h in starved] == ["a"]
    assert admission.stalled(31.0, 30.0, lambda r: True) == []  # its KV is all there


def sharded_admission(
    arrivals: dict[str, tuple[float, int]], num_blocks: int = 4, **knobs: float
) -> DecodeAdmission:
    """A group of `num_blocks` decoding `arrivals`: req_id -> (arrival time, tokens)."""
    admission = DecodeAdmission(num_blocks, BLOCK, **knobs)  # type: ignore[arg-type]
    for req_id, (at, tokens) in arrivals.items():
        admission.add(handoff(req_id, tokens=tokens, max_tokens=200, sharded=True), now=at)
    admission.admit(local_scheduler(), nothing_landed)
    return admission


def step(admission: DecodeAdmission, **tokens: int) -> None:
    """The given requests hold so many tokens at the next step (the others as they are)."""
    for seq in admission.sharded:
        seq.num_tokens = tokens.get(seq.req_id, seq.num_tokens)


def test_growth_preempts_the_youngest_first_and_counts_it():
    admission = sharded_admission({"a": (0.0, 16), "b": (1.0, 16), "c": (2.0, 16), "d": (3.0, 16)})
    step(admission, a=17, b=17, c=17, d=17)  # every one needs a second block: 8 > 4
    assert admission.fit_growth(now=10.0) == ["d", "c"]
    assert [s.req_id for s in admission.sharded] == ["a", "b"]
    assert admission.shard_blocks.num_used_blocks == 4 and admission.num_preemptions == 2
    assert [s.req_id for _, s in admission.preempted] == ["c", "d"]  # oldest resumes first
    assert admission.is_decoding_here("c")  # its shards are still this engine's to free


def test_growth_spares_a_request_at_the_preemption_cap_unless_nothing_else_is_left():
    admission = sharded_admission({"b": (1.0, 32), "c": (2.0, 16)}, 5, max_preemptions=1)
    admission.preempt("c", now=2.0)  # once: at the cap now
    # Room for its 17 tokens (2 blocks) beside b's 2 and a block the shards keep free for b.
    assert [s.req_id for s in admission.resumable(now=2.0)[0]] == ["c"]
    admission.resumed("c", 17)  # recomputed: its 16 tokens shipped, the 17th sampled
    step(admission, b=49)  # b needs a fourth block, c a second one: 6 > 5
    assert admission.fit_growth(now=3.0) == ["b"]  # c is younger, but capped
    last_resort = sharded_admission({"a": (0.0, 16), "b": (1.0, 16)}, max_preemptions=0)
    step(last_resort, a=64, b=17)  # 4 + 2 > 4, and both are at the cap (0)
    assert last_resort.fit_growth(now=1.0) == ["b"]


def test_a_starved_preempted_request_preempts_younger_ones_to_resume():
    """The mixed policy's aging: a preempted request that has waited `starvation_s` goes before
    younger ones (they are preempted for it, the youngest first); before that it waits for room."""
    admission = sharded_admission({"b": (1.0, 16), "c": (2.0, 16)}, 6, starvation_s=1.0)
    admission.preempt("c", now=2.0)
    admission.add(handoff("d", tokens=16, max_tokens=200, sharded=True), now=5.0)
    admission.add(handoff("e", tokens=16, max_tokens=200, sharded=True), now=6.0)
    admission.admit(local_scheduler(), nothing_landed)  # b, d, e: 3 blocks (+3 kept free)
    assert admission.resumable(now=2.5) == ([], [])  # not starved yet: it waits for room
    resumed, preempted = admission.resumable(now=3.0)
    assert [s.req_id for s in resumed] == ["c"] and preempted == ["e"]
    assert admission.resuming == {"c"} and [s.req_id for s in admission.sharded] == ["b", "d"]
    admission.remove("c")  # ended while it was recomputed: nothing of it is left
    admission.resumed("c", 17)
    assert not admission.is_decoding_here("c") and admission.shard_blocks.num_used_blocks == 2


def test_a_preempted_request_is_told_alive_to_its_router_until_it_decodes_again():
    """Its router re-runs a request that streams nothing for its progress deadline: a preempted
    one is named (for an empty output) once per `every_s` while it waits or is recomputed."""
    admission = sharded_admission({"a": (0.0, 16), "b": (1.0, 16)})
    admission.preempt("b", now=10.0)
    assert admission.quiet(now=14.0, every_s=5.0) == []
    assert admission.quiet(now=15.0, every_s=5.0) == ["b"]
    assert admission.quiet(now=19.0, every_s=5.0) == []
    admission.resumable(now=19.0)  # room: it is recomputed now, still quiet
    assert admission.quiet(now=20.0, every_s=5.0) == ["b"]
    admission.resumed("b", 17)
    assert admission.quiet(now=30.0, every_s=5.0) == []


def test_a_request_its_shards_keep_failing_backs_off_then_ends():
    """A row a shard fails (it refused or could not grow the request's KV: its count and the
    engine's disagree) is recomputed, each time a while later; past `MAX_RECOMPUTES` it ends."""
    admission = sharded_admission({"a": (0.0, 16)}, 8)
    for n in range(1, MAX_RECOMPUTES + 1):
        assert admission.recomputes("a", {"a"}) and not admission.recomputes("b", {"a"})
        admission.preempt("a", now=0.0)
        backoff = RECOMPUTE_BACKOFF_S * 2 ** (n - 1)
        assert admission.resumable(now=backoff - 0.01) == ([], [])
        assert [s.req_id for s in admission.resumable(now=backoff)[0]] == ["a"]
        admission.resumed("a", 17)
    assert not admission.recomputes("a", {"a"})  # its shards disagree for good: it ends
