"""The simulator's machine and the live `LLMEngine` run one machine-level policy: fed the same
recorded arrivals, they make the same decision at every iteration (who prefills, who decodes, who
is preempted), and the engine's block manager holds exactly the blocks the policy counts."""

from __future__ import annotations

from dataclasses import dataclass

from common.engine.core import LLMEngine
from common.perf_model import PerfModel, PiecewiseLinear
from common.roles import Role
from common.sampling_params import SamplingParams
from common.scheduling.mixed import MixedBatchPolicy, MixedPlan
from loadgen.sim.machine import SimMachine
from tests.conftest import random_prompts

NUM_BLOCKS, BLOCK_SIZE = 12, 16  # 192 tokens of KV: preemptions, by prompts and by growth
PROMPT_CAP = 128
MAX_PREEMPTIONS, STARVATION_S = 1, 3.0  # in iterations: the test's clock counts them


@dataclass(frozen=True)
class Arrival:
    iteration: int
    prompt_len: int
    output_len: int


# A recorded sequence: a burst, then stragglers while the first ones decode.
ARRIVALS = [
    Arrival(0, 40, 30), Arrival(0, 60, 20), Arrival(0, 50, 40), Arrival(2, 90, 10),
    Arrival(4, 20, 35), Arrival(5, 50, 25), Arrival(9, 70, 15), Arrival(12, 25, 30),
    Arrival(12, 30, 3), Arrival(20, 45, 1),
]  # fmt: skip

Decision = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # prefill, decode, preempted


def decision(plan: MixedPlan) -> Decision:
    def ids(req_ids: tuple[int | str, ...]) -> tuple[int, ...]:
        return tuple(int(str(r).removeprefix("r")) for r in req_ids)

    return ids(plan.prefill_ids), ids(plan.decode_ids), ids(plan.preempted_ids)


def simulated_decisions(engine: LLMEngine) -> list[Decision]:
    """The simulator's machine, one iteration per run, under the engine's own policy config."""
    flat = PiecewiseLinear((0.0, 1.0), (1.0, 1.0))
    policy = MixedBatchPolicy(engine.scheduler.policy.config)
    machine = SimMachine(0, Role.MIXED, policy, PerfModel(flat, flat))
    machine.max_run_steps = 1
    output_len = {i: a.output_len for i, a in enumerate(ARRIVALS)}
    decisions: list[Decision] = []
    iteration, done = 0, 0
    while done < len(ARRIVALS):
        for i, a in enumerate(ARRIVALS):
            if a.iteration == iteration:
                policy.add_prompt(i, a.prompt_len, float(iteration))
        run = machine.start(float(iteration), output_len)
        if run is not None:
            plan, finished = machine.complete()
            decisions.append(decision(plan))
            done += len(finished)
        iteration += 1
    return decisions


def test_simulator_and_engine_make_the_same_decisions(tiny_model_path):
    engine = LLMEngine.from_path(
        tiny_model_path, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
        max_num_batched_tokens=PROMPT_CAP, max_preemptions=MAX_PREEMPTIONS,
        starvation_s=STARVATION_S,
    )  # fmt: skip
    scheduler = engine.scheduler
    iteration = 0
    scheduler.clock = lambda: float(iteration)
    scheduler.plan_log = []
    prompts = random_prompts([a.prompt_len for a in ARRIVALS], 500, seed=3)
    outputs: dict[int, list[int]] = {i: [] for i in range(len(ARRIVALS))}
    while iteration <= ARRIVALS[-1].iteration or engine.has_unfinished():
        for i, a in enumerate(ARRIVALS):
            if a.iteration == iteration:
                params = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True)
                engine.add_request(f"r{i}", prompts[i], params)
        while True:  # one policy iteration: its prefill batch, then its decode batch
            for out in engine.step():
                outputs[int(out.req_id[1:])].extend(out.new_token_ids)
            if not scheduler.plan_in_progress:
                break
        # The engine's blocks are the policy's, exactly.
        assert engine.blocks.num_used_blocks == scheduler.policy.used_blocks
        iteration += 1
    engine_decisions = [decision(p) for p in scheduler.plan_log if not p.is_empty]

    assert engine_decisions == simulated_decisions(engine)
    # The recording exercises every rule: mixed iterations, preemptions, the prompt cap.
    assert any(prefill and decode for prefill, decode, _ in engine_decisions)
    assert scheduler.num_preemptions >= 2
    assert all(sum(ARRIVALS[i].prompt_len for i in p) <= PROMPT_CAP or len(p) == 1
               for p, _, _ in engine_decisions)  # fmt: skip
    # Every request ran to its length, greedy tokens as with room to spare.
    roomy = LLMEngine.from_path(tiny_model_path, num_blocks=64, block_size=BLOCK_SIZE)
    for i, a in enumerate(ARRIVALS):
        params = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True)
        assert outputs[i] == roomy.generate([prompts[i]], params)[0]
