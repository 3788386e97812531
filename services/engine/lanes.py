"""Decode lanes: one decode step's rows as n concurrent sub-batches over one shard group, staggered
layer by layer (Lamina 4.3: n = 2 or 3 inside one token engine).

While one lane waits for its shards' answer to a layer, the next lane runs its dense part (the
previous layer's O projection and MLP, this layer's QKV) and sends its own layer. Each lane is a
generator (`MeshModelRunner._lane`) that yields once per layer, after its sends and before it
reads the replies; `run_lanes` resumes them in turn. On one shard link the replies then come in
the order their layers were sent, which is the order the lanes read them.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass

import structlog
import torch

from common.scheduling.lane_choice import MeasuredSteps, choose_decode_lanes
from services.engine.shard_round_trip import DecodeTimes

log = structlog.get_logger(__name__)

# A lane's layers: yields its in-flight sends (an opaque token) after each layer's sends; returns
# its rows' hidden states [rows, hidden] after the last layer.
LaneRun = Generator[object, None, torch.Tensor]


@dataclass(frozen=True)
class LaneRows:
    """Rows [start, end) of the step's `[local | sharded]` rows; the first `num_local` of them
    attend locally (lane 0 takes every local row: they never wait)."""

    lane: int
    start: int
    end: int
    num_local: int
    sharded_start: int  # its first sharded row's index among the step's sharded rows
    sharded_end: int


def split_lanes(num_local: int, num_sharded: int, num_lanes: int) -> list[LaneRows]:
    """The step's rows as up to `num_lanes` lanes, the sharded rows split evenly (earlier lanes
    take the remainder); fewer lanes when there are fewer sharded rows than lanes."""
    num_lanes = max(1, min(num_lanes, num_sharded))
    lanes, start = [], 0
    for lane in range(num_lanes):
        size = num_sharded // num_lanes + (lane < num_sharded % num_lanes)
        local = num_local if lane == 0 else 0
        lanes.append(LaneRows(lane, num_local * (lane > 0) + start, num_local + start + size,
                              local, start, start + size))  # fmt: skip
        start += size
    return lanes


def run_lanes(
    lanes: list[LaneRun], drain: Callable[[object, BaseException], None]
) -> list[torch.Tensor]:
    """Run the lanes round robin to their ends; their results in lane order.

    When one lane raises, every other lane's sends still in flight are read (`drain(in_flight,
    error)`), so that no reply is left on a link for the next step to take; then that error is
    raised.
    """
    results: list[torch.Tensor | None] = [None] * len(lanes)
    in_flight: list[object | None] = [None] * len(lanes)
    live = list(range(len(lanes)))
    while live:
        for j in list(live):
            try:
                in_flight[j] = next(lanes[j])
            except StopIteration as done:
                results[j], in_flight[j] = done.value, None
                live.remove(j)
            except BaseException as error:
                for other in live:
                    if other != j and (sends := in_flight[other]) is not None:
                        drain(sends, error)
                raise
    return [r for r in results if r is not None]


class AutoLanes:
    """`decode_lanes: auto`: one lane for the first `warmup_steps` sharded decode steps, then the
    n that `choose` (common/scheduling/lane_choice.py) prices best from what they measured and
    the model peers linked then, chosen once: a step run as lanes no longer measures one lane's
    costs."""

    def __init__(
        self,
        num_layers: int,
        warmup_steps: int = 64,
        choose: Callable[[MeasuredSteps, int], int] = choose_decode_lanes,
    ) -> None:
        self.num_layers, self.warmup_steps, self.choose = num_layers, warmup_steps, choose
        self.chosen: int | None = None

    def lanes(self, times: DecodeTimes, num_peers: int = 0) -> int:
        """How many lanes the next step runs, given the breakdown of the steps so far and the
        model peers linked now."""
        if self.chosen is None and times.num_steps >= self.warmup_steps:
            measured = MeasuredSteps(times.num_steps, self.num_layers, times.step_s,
                                     times.wait_s, times.attend_s, times.network_s)  # fmt: skip
            self.chosen = self.choose(measured, num_peers)
            log.info("decode lanes chosen", decode_lanes=self.chosen, num_peers=num_peers,
                     measured=str(measured))  # fmt: skip
        return self.chosen or 1
