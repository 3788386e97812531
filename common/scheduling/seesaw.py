"""Seesaw's offline scheduling (§4.2): when a group of workers prefills and when it decodes.

An offline group prefills with one sharding (pipeline parallel: layers split over the workers) and
decodes with another (tensor parallel: heads and MLP columns split), and every switch between the
two costs a re-shard. Prefilled KV waits in a CPU buffer shared by the workers; decoding takes it
from there into the decode slots (swap-in, where the KV is re-sharded by heads).

Schedules (`Schedule`):

- `TRANSITION_MINIMIZING` (Seesaw): prefill until the buffer is full or nothing waits, then
  decode, swapping buffered requests in as decode slots free; go back to prefill only once the
  buffer is empty. Transitions happen when the buffer is full or empty, never more often.
- `PREFILL_FIRST` (vLLM's default, the paper's baseline): prefill whenever a request waits and
  the buffer has room; decode otherwise. Transitions at nearly every arrival of room.
- `DECODE_FIRST`: decode while anything is decoding or buffered; prefill only when nothing is.
  Few transitions, small decode batches.

Pure and shared with the simulator: the caller applies the returned `Step` and updates the state.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field


class Stage(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class Schedule(enum.Enum):
    TRANSITION_MINIMIZING = "seesaw"
    PREFILL_FIRST = "prefill_first"
    DECODE_FIRST = "decode_first"


@dataclass(frozen=True)
class Waiting:
    req_id: int
    num_tokens: int  # its prompt


@dataclass
class OfflineState:
    """What the scheduler sees: requests by where their KV is, and the room left."""

    waiting: list[Waiting]  # not prefilled yet, in arrival order
    buffered: list[int]  # prefilled, KV in the CPU buffer, not yet in a decode slot
    decoding: list[int]  # in decode slots
    free_buffer_slots: int
    free_decode_slots: int
    stage: Stage = Stage.PREFILL


@dataclass(frozen=True)
class Step:
    """One step: prefill `prefill` (into the buffer), or swap `swap_in` into decode slots and
    decode every decoding request. `transition`: the stage changed (a re-shard) before it."""

    stage: Stage
    prefill: tuple[int, ...] = ()
    swap_in: tuple[int, ...] = ()
    transition: bool = False


@dataclass(frozen=True)
class SeesawKnobs:
    max_prefill_tokens: int = 2048  # tokens per prefill batch
    schedule: Schedule = Schedule.TRANSITION_MINIMIZING


@dataclass
class StepCounts:
    num_prefills: int = 0
    num_decodes: int = 0
    num_transitions: int = 0
    stages: list[Stage] = field(default_factory=list)


def next_step(state: OfflineState, knobs: SeesawKnobs) -> Step | None:
    """The next step, or None when there is nothing left to do."""
    if not (state.waiting or state.buffered or state.decoding):
        return None
    can_prefill = bool(state.waiting) and state.free_buffer_slots > 0
    can_decode = bool(state.decoding) or (bool(state.buffered) and state.free_decode_slots > 0)
    schedule = knobs.schedule
    if schedule is Schedule.PREFILL_FIRST:
        stage = Stage.PREFILL if can_prefill else Stage.DECODE
    elif schedule is Schedule.DECODE_FIRST:
        stage = Stage.DECODE if can_decode else Stage.PREFILL
    elif state.stage is Stage.PREFILL:
        # Fill the buffer; decode once it is full (or nothing is left to prefill).
        stage = Stage.PREFILL if can_prefill else Stage.DECODE
    else:
        # Drain the buffer; prefill again only once it is empty (or decoding can't go on).
        buffer_empty = not state.buffered
        stage = Stage.PREFILL if (buffer_empty and can_prefill) or not can_decode else Stage.DECODE
    if stage is Stage.PREFILL and not can_prefill:
        stage = Stage.DECODE  # nothing to prefill into: the only way on is to decode
    if stage is Stage.DECODE and not can_decode:
        return None if not can_prefill else _prefill(state, knobs)
    if stage is Stage.PREFILL:
        return _prefill(state, knobs)
    swap = tuple(state.buffered[: state.free_decode_slots])
    return Step(Stage.DECODE, swap_in=swap, transition=state.stage is not Stage.DECODE)


def _prefill(state: OfflineState, knobs: SeesawKnobs) -> Step:
    chosen: list[int] = []
    tokens = 0
    for w in state.waiting[: state.free_buffer_slots]:
        if chosen and tokens + w.num_tokens > knobs.max_prefill_tokens:
            break
        chosen.append(w.req_id)
        tokens += w.num_tokens
    return Step(Stage.PREFILL, prefill=tuple(chosen), transition=state.stage is not Stage.PREFILL)


def apply(state: OfflineState, step: Step, finished: Sequence[int] = ()) -> None:
    """Move requests by `step` (prefilled into the buffer; swapped into slots) and drop those
    that `finished` after it (from the buffer or a decode slot), freeing their room."""
    state.stage = step.stage
    if step.prefill:
        chosen = set(step.prefill)
        state.waiting = [w for w in state.waiting if w.req_id not in chosen]
        state.buffered.extend(step.prefill)
        state.free_buffer_slots -= len(step.prefill)
    if step.swap_in:
        moved = set(step.swap_in)
        state.buffered = [r for r in state.buffered if r not in moved]
        state.decoding.extend(step.swap_in)
        state.free_buffer_slots += len(step.swap_in)
        state.free_decode_slots -= len(step.swap_in)
    if finished:
        done = set(finished)
        # A request can end at its first token (its prefill's): it leaves the buffer at once.
        buffered = [r for r in state.buffered if r not in done]
        state.free_buffer_slots += len(state.buffered) - len(buffered)
        state.buffered = buffered
        kept = [r for r in state.decoding if r not in done]
        state.free_decode_slots += len(state.decoding) - len(kept)
        state.decoding = kept
