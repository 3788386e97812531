"""Mixed-machine batching rules (Splitwise §IV-B) on fabricated machine states."""

from common.scheduling.mixed import MixedBatchPolicy, MixedPolicyConfig


def policy(kv: int = 10_000, cap: int = 2048, max_preemptions: int = 2, starvation_s: float = 1.0):
    return MixedBatchPolicy(MixedPolicyConfig(kv, cap, max_preemptions, starvation_s))


def test_prompts_batched_fcfs_up_to_token_cap():
    p = policy()
    for req_id, length in enumerate([1000, 900, 500, 10]):
        p.add_prompt(req_id, length, arrival_s=float(req_id))
    plan = p.schedule(now=5.0)
    # 1000 + 900 fit in 2048; 500 would not, and FCFS never lets the 10-token prompt skip it.
    assert plan.prefill_ids == (0, 1) and plan.num_prefill_tokens == 1900
    assert p.pending_prompt_tokens == 510


def test_prompt_longer_than_cap_runs_alone():
    p = policy()
    p.add_prompt(0, 5000, 0.0)
    p.add_prompt(1, 10, 0.1)
    assert p.schedule(1.0).prefill_ids == (0,)
    assert p.schedule(1.1).prefill_ids == (1,)


def test_prompts_and_running_decodes_share_an_iteration():
    p = policy()
    p.add_prompt(0, 100, 0.0)
    p.schedule(0.0)
    p.add_prompt(1, 200, 0.5)
    plan = p.schedule(0.6)
    assert plan.prefill_ids == (1,) and plan.decode_ids == (0,)
    assert p.num_generated(0) == 2  # first token from the prefill, one from this decode step


def test_kv_accounting_follows_steps_and_advance():
    p = policy()
    p.add_prompt(0, 100, 0.0)
    p.schedule(0.0)  # prefill: 100 prompt tokens + first token
    assert p.kv_used == 101
    p.schedule(0.1)
    p.advance(9)  # ten decode steps in all
    assert p.num_generated(0) == 11 and p.kv_used == 111
    p.finish(0)
    assert p.kv_used == 0


def test_prompt_preempts_youngest_decode_when_memory_is_full():
    p = policy(kv=1000)
    p.add_prompt(0, 400, arrival_s=0.0)  # oldest
    p.add_prompt(1, 400, arrival_s=1.0)  # youngest
    p.schedule(1.0)
    p.add_prompt(2, 300, arrival_s=2.0)
    plan = p.schedule(2.0)
    assert plan.prefill_ids == (2,)
    assert plan.preempted_ids == (1,)
    assert plan.decode_ids == (0,)
    assert set(p.running) == {0, 2}


def test_no_preemption_when_it_cannot_free_enough():
    p = policy(kv=1000)
    p.add_prompt(0, 400, 0.0)
    p.schedule(0.0)
    p.add_prompt(1, 900, 1.0)  # would need 901 free; only 599 + 401 reclaimable = 1000 is OK
    p.add_prompt(2, 2000, 1.0)
    plan = p.schedule(1.0)
    assert plan.prefill_ids == (1,) and plan.preempted_ids == (0,)
    plan = p.schedule(1.1)
    assert plan.prefill_ids == () and plan.preempted_ids == ()  # 2001 tokens can never fit


def test_preemption_cap_protects_a_request():
    p = policy(kv=1000, max_preemptions=1)
    p.add_prompt(0, 400, 0.0)
    p.schedule(0.0)
    p.add_prompt(1, 700, 1.0)
    assert p.schedule(1.0).preempted_ids == (0,)
    p.finish(1)
    # Request 0 is resumed (recomputed) and has used its one preemption.
    plan = p.schedule(1.5)
    assert plan.prefill_ids == (0,) and p.running[0].num_preemptions == 1
    p.add_prompt(2, 700, 2.0)
    plan = p.schedule(2.0)
    assert plan.preempted_ids == () and plan.prefill_ids == ()
    assert 0 in p.running


def test_aged_preempted_request_goes_before_new_prompts():
    p = policy(kv=1000, cap=2048, starvation_s=1.0)
    p.add_prompt(0, 400, 0.0)
    p.schedule(0.0)
    p.add_prompt(1, 800, 0.5)
    assert p.schedule(0.5).preempted_ids == (0,)
    p.add_prompt(2, 100, 0.6)
    p.finish(1)
    # Waited 0.2 s < starvation_s: the new prompt goes first.
    assert p.schedule(0.7).prefill_ids[0] == 2
    p.finish(2)
    p2 = policy(kv=1000, starvation_s=1.0)
    p2.add_prompt(0, 400, 0.0)
    p2.schedule(0.0)
    p2.add_prompt(1, 800, 0.5)
    p2.schedule(0.5)
    p2.finish(1)
    p2.add_prompt(2, 100, 0.6)
    # Waited 2 s >= starvation_s: the preempted request outranks the new prompt.
    assert p2.schedule(2.5).prefill_ids[0] == 0


def test_resumed_request_recomputes_prompt_and_generated_tokens():
    p = policy(kv=1000)
    p.add_prompt(0, 300, 0.0)
    p.schedule(0.0)
    p.schedule(0.1)
    p.advance(4)  # 1 + 5 tokens generated
    p.add_prompt(1, 900, 1.0)
    assert p.schedule(1.0).preempted_ids == (0,)
    assert p.pending_prompt_tokens == 306
    p.finish(1)
    plan = p.schedule(2.0)
    assert plan.num_prefill_tokens == 306 and p.num_generated(0) == 7


def test_arrived_decodes_wait_fcfs_for_memory():
    p = policy(kv=1000)
    p.add_decode(0, 600, arrival_s=0.0, now=0.0)
    p.add_decode(1, 600, arrival_s=0.1, now=0.1)
    plan = p.schedule(0.2)
    assert plan.decode_ids == (0,) and p.has_waiting
    p.finish(0)
    assert p.schedule(0.3).decode_ids == (1,)


def test_decode_growth_preempts_youngest_when_memory_runs_out():
    p = policy(kv=207)
    p.add_decode(0, 100, arrival_s=0.0, now=0.0)
    p.add_decode(1, 100, arrival_s=1.0, now=1.0)
    # Each lands holding prompt + first token (101) and decodes at once: 204 used after.
    assert p.schedule(1.0).decode_ids == (0, 1) and p.kv_used == 204
    plan = p.schedule(1.1)  # needs 2 more, 3 free
    assert plan.preempted_ids == () and p.kv_used == 206
    plan = p.schedule(1.2)  # needs 2 more, 1 free: the younger goes
    assert plan.preempted_ids == (1,) and plan.decode_ids == (0,)
    assert p.max_decode_steps() == p.kv_free


def test_default_prompt_batch_cap_is_2048_tokens():
    p = MixedBatchPolicy(MixedPolicyConfig(kv_capacity_tokens=100_000))
    for req_id in range(5):
        p.add_prompt(req_id, 600, arrival_s=float(req_id))
    plan = p.schedule(now=5.0)
    assert plan.prefill_ids == (0, 1, 2) and plan.num_prefill_tokens == 1800


def test_prompts_get_memory_before_waiting_decodes():
    p = policy(kv=1000)
    p.add_decode(0, 500, arrival_s=0.0, now=0.5)  # KV landed first
    p.add_prompt(1, 600, arrival_s=1.0)
    plan = p.schedule(1.0)
    # Only one fits: the prompt is admitted, the landed decode waits for memory.
    assert plan.prefill_ids == (1,) and plan.decode_ids == ()
    assert p.has_waiting and 0 not in p.running
    p.finish(1)
    assert p.schedule(1.1).decode_ids == (0,)


def test_older_decode_survives_and_younger_is_preempted_whatever_the_join_order():
    p = policy(kv=1000)
    p.add_decode(5, 300, arrival_s=3.0, now=3.0)  # joined first, but arrived later (younger)
    p.add_decode(6, 300, arrival_s=1.0, now=3.1)  # joined second, older request
    p.schedule(3.2)
    p.add_prompt(7, 500, arrival_s=4.0)
    plan = p.schedule(4.0)
    assert plan.preempted_ids == (5,) and set(plan.decode_ids) == {6}


def test_a_plan_never_holds_more_blocks_than_the_machine_has():
    """A prefill takes room for its prompt and the token it generates: two resumed requests whose
    prefills end on a block boundary each take one more block at that token. The policy counted
    it for each alone, not for the ones admitted before it in the same iteration, so its plan
    overcommitted (an engine's `BlockManager` then raised `NoFreeBlocksError` mid-step)."""
    p = MixedBatchPolicy(MixedPolicyConfig(128, block_size=16, starvation_s=0.0))  # 8 blocks
    for i in range(4):  # KV landed from a prompt machine: 30 tokens (+ its first one) each
        p.add_decode(f"r{i}", 30, arrival_s=float(i), now=float(i), resident=True)
    for step in range(400):
        if not p.running and not p.has_waiting:
            break
        plan = p.schedule(now=10.0 + step)
        assert p.free_blocks >= 0, (step, plan)
        for req_id in list(p.running):  # ends at 40 tokens generated
            if req_id not in plan.prefill_ids and p.num_generated(req_id) >= 40:
                p.finish(req_id)
    assert p.num_preemptions > 0 and not p.running and not p.has_waiting
