"""The engines' scheduler (`EngineScheduler`: the mixed policy over a real BlockManager) on
fabricated states (pure: no model)."""

from __future__ import annotations

from common.block_manager import BlockManager, NoFreeBlocksError
from common.config import SchedulerConfig
from common.scheduling.batching import EngineScheduler, Phase, Sequence


def make(num_blocks=64, block_size=16, budget=2048, max_seqs=64) -> EngineScheduler:
    return EngineScheduler(BlockManager(num_blocks, block_size), SchedulerConfig(budget, max_seqs))


def test_prefill_batches_are_fcfs_and_capped_at_the_token_budget():
    s = make(num_blocks=1000, budget=2048)
    for i, n in enumerate([1000, 900, 300, 10]):
        s.add(Sequence(f"r{i}", n))
    batch = s.schedule()
    assert batch and batch.phase is Phase.PREFILL
    # 1000 + 900 fit; 300 would pass 2048 and FCFS forbids the 10-token prompt skipping ahead.
    assert [q.req_id for q in batch.seqs] == ["r0", "r1"]
    assert batch.num_tokens == 1900


def test_a_prompt_longer_than_the_budget_runs_alone():
    s = make(num_blocks=1000, budget=2048)
    s.add(Sequence("long", 3000))
    s.add(Sequence("short", 5))
    batch = s.schedule()
    assert batch and [q.req_id for q in batch.seqs] == ["long"]


def test_prompts_go_first_on_a_mixed_machine_then_everyone_decodes():
    s = make()
    s.add(Sequence("a", 10))
    first = s.schedule()
    assert first and first.phase is Phase.PREFILL
    s.update(first, finished=set())
    s.add(Sequence("b", 10))
    # One mixed iteration: b's prefill, then a's decode (the runner runs one phase at a time).
    second = s.schedule()
    assert second and second.phase is Phase.PREFILL and second.seqs[0].req_id == "b"
    s.update(second, finished=set())
    rest = s.schedule()
    assert rest and rest.phase is Phase.DECODE and [q.req_id for q in rest.seqs] == ["a"]
    s.update(rest, finished=set())
    third = s.schedule()
    assert third and third.phase is Phase.DECODE
    assert [q.req_id for q in third.seqs] == ["a", "b"]
    assert s.plan_log is None  # recording is opt-in


def test_out_of_blocks_preempts_the_youngest_and_requeues_it_first():
    s = make(num_blocks=5, block_size=4)
    for name in ("old", "young"):
        s.add(Sequence(name, 4))
    prefill = s.schedule()
    assert prefill and [q.req_id for q in prefill.seqs] == ["old", "young"]
    s.update(prefill, set())
    # The policy reserves the slot of the token each iteration generates: the prefill holds 5
    # tokens (2 blocks each, 1 free), three decodes reach 8; the next needs 2 more blocks.
    for _ in range(3):
        step = s.schedule()
        assert step and step.phase is Phase.DECODE and not step.preempted
        s.update(step, set())
    step = s.schedule()
    assert step and [q.req_id for q in step.preempted] == ["young"]
    assert [q.req_id for q in step.seqs] == ["old"]
    assert s.waiting[0].req_id == "young" and s.waiting[0].num_computed == 0
    assert s.num_preemptions == 1 and s.blocks.num_free_blocks == 2


def test_token_machine_decodes_only_admitted_sequences():
    s = make()
    assert s.schedule() is None
    s.blocks.allocate("ready", 11)
    s.add_running(Sequence("ready", 11))
    batch = s.schedule()
    assert batch and batch.phase is Phase.DECODE and [q.req_id for q in batch.seqs] == ["ready"]


def test_remove_frees_blocks_of_waiting_and_running():
    s = make(num_blocks=8, block_size=4)
    s.add(Sequence("a", 5))
    s.add(Sequence("b", 5))
    s.update(s.schedule(), set())  # type: ignore[arg-type]
    assert s.remove("a") and s.remove("b") and not s.remove("c")
    assert s.blocks.num_free_blocks == 8 and s.num_unfinished == 0


def test_a_decode_the_blocks_cannot_grow_is_preempted_alone_not_raised():
    """Should the policy's count and the blocks' ever disagree, the decode found without room
    waits to be recomputed (from the tokens it has, none counted twice); its batch-mates step."""

    class Refusing(BlockManager):
        refuse: set[str] = set()

        def grow(self, req_id: str, num_tokens: int) -> list[int]:
            if req_id in self.refuse and num_tokens > len(self.block_table(req_id)) * 16:
                raise NoFreeBlocksError(f"request {req_id}: refused")
            return super().grow(req_id, num_tokens)

    s = EngineScheduler(Refusing(64, 16), SchedulerConfig())
    for req_id, num_tokens in (("a", 11), ("b", 16)):
        s.blocks.allocate(req_id, num_tokens - 1)  # its KV, landed from a prompt machine
        s.add_running(Sequence(req_id, num_tokens))
    Refusing.refuse = {"b"}  # b's next token starts a block: none comes
    step = s.schedule()
    assert step and [q.req_id for q in step.seqs] == ["a"]
    assert [q.req_id for q in step.preempted] == ["b"] and not s.blocks.has("b")
    s.update(step, set())
    Refusing.refuse = set()
    again = s.schedule()  # b's recompute: its 16 tokens (15 prompt + its first), no more
    assert again and again.phase is Phase.PREFILL and [q.req_id for q in again.seqs] == ["b"]
    assert (again.seqs[0].num_tokens, again.seqs[0].num_computed) == (16, 0)
