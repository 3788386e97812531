"""`decode_lanes: auto`: how many staggered lanes (Lamina 4.3) a token engine's decode steps run,
from what its steps with one lane measured (the runner's `DecodeTimes` breakdown).

Per layer, the measured costs are t_m (the engine busy: the step less its wait on replies), t_a
(the slowest shard's attention) and t_net (the rest of the round trip); `choose_num_batches` then
prices n lanes on R compute replicas (the engine and its P linked model peers, R = 1 + P: the
rotation runs lane j's slice k on replica (j + k) mod R) and one memory group (its shards).

NOTE: a slice on a peer adds a relay the one-lane warm-up cannot measure (the lane's context to the
peer, q/k/v back, services/engine/rotation.py); it is priced as one more shard round trip's
network time (t_net: the same engine, the same kind of link, similar bytes) on the (R - 1) / R of
slices that run on peers. With no peers (R = 1) the choice is as before.

NOTE: each lane's dense part is priced at the whole step's t_m, not t_m / n. Decode's dense layers
at small batch stream their weights whatever the number of rows (docs/mesh.md: two M=4 layers
cost about twice one M=8), so n lanes cost the engine n x t_m; attention, which is per row,
splits. So lanes are chosen only when the engine would idle on its shards for longer than it
computes, and a wrong guess errs towards n = 1 (what `decode_lanes: 1` runs anyway).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.scheduling.lamina_pipeline import LayerCosts, choose_num_batches

MAX_AUTO_LANES = 3  # Lamina's n is 2 or 3 on one replica; n = R + 1 over R replicas


@dataclass(frozen=True)
class MeasuredSteps:
    """Sums over `num_steps` decode steps of `num_layers` layers each, run with one lane."""

    num_steps: int
    num_layers: int
    step_s: float
    wait_s: float  # the engine blocked on its shards' replies
    attend_s: float  # per layer, the slowest shard's attention, summed
    network_s: float  # per layer, the rest of that round trip, summed


def choose_decode_lanes(
    measured: MeasuredSteps, num_peers: int = 0, max_lanes: int = MAX_AUTO_LANES
) -> int:
    """The n in 1..`max_lanes` (at least R + 1 with `num_peers` linked model peers, R = 1 +
    `num_peers`) with the shortest per-layer period; ties go to fewer lanes."""
    if measured.num_steps < 1 or measured.num_layers < 1:
        raise ValueError(f"lane choice: nothing measured yet: {measured}")
    if num_peers < 0:
        raise ValueError(f"lane choice: num_peers must be >= 0, got {num_peers}")
    per_layer = measured.num_steps * measured.num_layers
    t_m = max(measured.step_s - measured.wait_s, 0.0) / per_layer
    t_a = max(measured.attend_s, 0.0) / per_layer
    t_net = max(measured.network_s, 0.0) / per_layer
    if t_m + t_a + t_net <= 0:  # nothing took any time: no reason to split
        return 1
    replicas = 1 + num_peers

    def costs_for(n: int) -> LayerCosts:
        # With one lane every slice runs on the engine (the rotation needs two lanes or more).
        relay_s = t_net * (replicas - 1) / replicas if n > 1 else 0.0
        return LayerCosts(model_s=t_m, attention_s=t_a / n, latency_s=(t_net + relay_s) / 2)

    lanes = max(max_lanes, replicas + 1)
    plan = choose_num_batches(costs_for, lanes, num_replicas=replicas, overlap=False)
    return plan.num_batches


__all__ = ["MAX_AUTO_LANES", "MeasuredSteps", "choose_decode_lanes"]
