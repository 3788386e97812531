"""Seesaw's offline schedules (common/scheduling/seesaw.py) driven to the end of a job."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.scheduling.seesaw import (
    OfflineState,
    Schedule,
    SeesawKnobs,
    Stage,
    Waiting,
    apply,
    next_step,
)


def run(schedule: Schedule, lengths: list[tuple[int, int]], buffer_slots: int,
        decode_slots: int, max_prefill_tokens: int = 64) -> list[Stage]:  # fmt: skip
    """Replay a job of (prompt, output) lengths; checks the room never runs over. The stages."""
    state = OfflineState([Waiting(i, p) for i, (p, _) in enumerate(lengths)], [], [],
                         buffer_slots, decode_slots)  # fmt: skip
    left = {i: out for i, (_, out) in enumerate(lengths)}
    knobs = SeesawKnobs(max_prefill_tokens, schedule)
    stages = []
    while (step := next_step(state, knobs)) is not None:
        stages.append(step.stage)
        finished = []
        if step.stage is Stage.PREFILL:
            assert step.prefill and not step.swap_in
            assert len(step.prefill) == 1 or sum(lengths[i][0] for i in step.prefill) <= 64
            for i in step.prefill:
                left[i] -= 1
                if left[i] == 0:
                    finished.append(i)
        else:
            for i in [*state.decoding, *step.swap_in]:
                left[i] -= 1
                if left[i] == 0:
                    finished.append(i)
        apply(state, step, finished)
        assert 0 <= state.free_buffer_slots <= buffer_slots
        assert 0 <= state.free_decode_slots <= decode_slots
        assert len(state.buffered) + state.free_buffer_slots == buffer_slots
        assert len(state.decoding) + state.free_decode_slots == decode_slots
        assert len(stages) < 10_000
    assert all(n == 0 for n in left.values())  # every request ran to its end
    return stages


def transitions(stages: list[Stage]) -> int:
    return sum(a is not b for a, b in zip(stages, stages[1:], strict=False))


def job(n: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(4, 40), rng.randint(1, 30)) for _ in range(n)]


def test_transition_minimizing_switches_only_when_the_buffer_is_full_or_empty() -> None:
    lengths = job(60, 1)
    seesaw = run(Schedule.TRANSITION_MINIMIZING, lengths, buffer_slots=16, decode_slots=8)
    eager = run(Schedule.PREFILL_FIRST, lengths, buffer_slots=16, decode_slots=8)
    assert transitions(seesaw) * 3 <= transitions(eager)
    # Each prefill stage fills the buffer (bar the last, when nothing more waits): 60 requests
    # through a 16-slot buffer is at least 4 prefill stages, and not many more.
    prefill_stages = sum(1 for a, b in zip([None, *seesaw], seesaw, strict=False)
                         if b is Stage.PREFILL and a is not Stage.PREFILL)  # fmt: skip
    assert 4 <= prefill_stages <= 8


def test_decode_first_decodes_while_anything_can() -> None:
    stages = run(Schedule.DECODE_FIRST, job(30, 2), buffer_slots=4, decode_slots=4)
    assert stages[0] is Stage.PREFILL and Stage.DECODE in stages


def test_a_request_that_ends_at_its_prefill_leaves_the_buffer() -> None:
    state = OfflineState([Waiting(0, 5), Waiting(1, 5)], [], [], 1, 1)
    knobs = SeesawKnobs()
    step = next_step(state, knobs)
    assert step is not None and step.prefill == (0,)
    apply(state, step, finished=[0])
    assert state.free_buffer_slots == 1 and not state.buffered
    step = next_step(state, knobs)
    assert step is not None and step.prefill == (1,)


def test_nothing_left_is_none() -> None:
    assert next_step(OfflineState([], [], [], 4, 4), SeesawKnobs()) is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 90), st.integers(1, 12)), min_size=1, max_size=25),
       st.integers(1, 6), st.integers(1, 6), st.sampled_from(list(Schedule)))  # fmt: skip
def test_every_schedule_finishes_every_job_within_its_room(
    lengths: list[tuple[int, int]], buffer_slots: int, decode_slots: int, schedule: Schedule
) -> None:
    run(schedule, lengths, buffer_slots, decode_slots)


@pytest.mark.parametrize("schedule", list(Schedule))
def test_a_prompt_longer_than_the_prefill_budget_still_runs_alone(schedule: Schedule) -> None:
    run(schedule, [(500, 3), (10, 2)], buffer_slots=2, decode_slots=1)
