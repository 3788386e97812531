"""A token engine's two KV tiers (Neo §3): its own local KV and its shard group. Each iteration a
`TierPolicy` (common/scheduling/tiers.py) says which decode requests move between them; `KvSwaps`
(kv_swaps.py) moves them; `KvTiers` feeds the policy and turns finished moves into scheduling: a
swapped-in request joins the local scheduler (its shards dropped their copies when they sent
them), a swapped-out one joins the sharded rows. A failed or stalled move ends its request alone,
retryably (the router re-runs it from its tokens), freeing both tiers' copies.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence as Seq

import structlog
import torch

from common.block_manager import NoFreeBlocksError
from common.protocol import KvEvent, KvPages, KvSwapAck, ShardAddress
from common.scheduling.batching import EngineScheduler
from common.scheduling.neo_tiers import NeoTierPolicy
from common.scheduling.tiers import Tier, TierPolicy, TierRequest, TierState, is_neo, tier_policy
from services.engine.admission import DecodeAdmission
from services.engine.cost_probe import EngineNeoCosts, probe_costs, read_costs
from services.engine.kv_swaps import SWAP_TIMEOUT_S, KvSwaps, SwapFailed
from services.engine.outbox import Outbox
from services.engine.requests import RequestTable
from services.engine.runner import MeshModelRunner

log = structlog.get_logger(__name__)


class KvTiers:
    """The tier policy and the swaps in flight; `swaps` None: one tier (no local budget, or no
    KV listener for the shards' replies), and every plan is empty."""

    def __init__(
        self,
        policy: TierPolicy,
        swaps: KvSwaps | None,
        local_kv_blocks: int,
        runner: MeshModelRunner,
    ) -> None:
        self.policy, self.swaps, self.local_kv_blocks = policy, swaps, local_kv_blocks
        self.runner = runner  # its decode times feed a Neo cost model
        self.two_batch = False  # the policy's choice for this iteration's decode (Neo §3.1)
        self.predicted_step_s: float | None = None  # its estimate of this iteration's step
        self.kv_events: deque[KvEvent] = deque(maxlen=256)  # `swapped_in` / `swapped_out`

    def plan(
        self,
        table: RequestTable,
        local: EngineScheduler,
        admission: DecodeAdmission,
        shards: Seq[ShardAddress],
    ) -> Outbox:
        """Between steps: start the swaps the policy plans (the fetches to send, for swap-ins)."""
        swaps = self.swaps
        self.predicted_step_s = None  # no plan, no prediction
        if swaps is None or not shards or local.plan_in_progress:
            return Outbox()
        costs = self._neo_costs()
        if costs is not None:  # T_ca's round trip, as this engine's sharded steps took it
            times = self.runner.times  # `two_batch` is still the step just run's
            costs.observe(times.num_steps, times.network_s, overlapped=self.two_batch)
        state = TierState(self._requests(table, local, admission, swaps), self.local_kv_blocks,
                          local.blocks.block_size)  # fmt: skip
        plan = self.policy.plan(state)
        self.two_batch, self.predicted_step_s = plan.two_batch, plan.predicted_step_s
        now, out = time.monotonic(), Outbox()
        running = {s.req_id: s for s in local.running}
        for req_id in plan.swap_out:
            if req_id in running and req_id in table:
                local.detach(req_id)
                swaps.swap_out(running[req_id], shards, table.whole_len(req_id), now)
        sharded = {s.req_id: s for s in admission.sharded}
        for req_id in plan.swap_in:
            if req_id not in sharded:
                continue
            try:
                out += swaps.swap_in(sharded[req_id], shards, now)
            except NoFreeBlocksError:  # the budget is larger than the cache: it stays offloaded
                continue
            admission.remove(req_id)  # out of the sharded rows; its mirror room back
        return out

    def step_measured(self, measured_s: float) -> None:
        """The decode step the policy predicted took `measured_s`: fed back to a Neo cost
        model's step overhead."""
        costs = self._neo_costs()
        if costs is not None and self.predicted_step_s is not None:
            costs.observe_step(self.predicted_step_s, measured_s)

    def _neo_costs(self) -> EngineNeoCosts | None:
        policy = self.policy
        if isinstance(policy, NeoTierPolicy) and isinstance(policy.costs, EngineNeoCosts):
            return policy.costs
        return None

    def _requests(
        self,
        table: RequestTable,
        local: EngineScheduler,
        admission: DecodeAdmission,
        swaps: KvSwaps,
    ) -> list[TierRequest]:
        tiers = [(s, Tier.LOCAL) for s in local.running]
        arriving = admission.arriving  # KV still landing on the shards: not movable yet
        tiers += [(s, Tier.ARRIVING if s.req_id in arriving else Tier.OFFLOADED)
                  for s in admission.sharded]  # fmt: skip
        tiers += [(m.seq, Tier.MOVING) for m in swaps.moving.values()]
        return [
            TierRequest(s.req_id, tier, s.num_tokens,
                        len(table.requests[s.req_id].output_token_ids), table.whole_len(s.req_id))
            for s, tier in tiers if s.req_id in table
        ]  # fmt: skip

    def on_ack(self, ack: KvSwapAck, table: RequestTable, admission: DecodeAdmission) -> str:
        """A shard has (or could not take, or serve) a request's swapped KV; the error that ends
        the request, or ""."""
        if self.swaps is None:
            return ""
        try:
            move = self.swaps.on_ack(ack)
        except SwapFailed as exc:
            return str(exc) if ack.req_id in table else ""
        if move is not None:
            self.kv_events.append(KvEvent("swapped_out", ack.req_id, 0, time.monotonic()))
            admission.add_sharded(move.seq, move.reserve_tokens)
            # It may have come with local KV (no shards in its route): they free it from now on.
            table.routes[ack.req_id].shards = move.shards
        return ""

    def is_swapping_in(self, req_id: str) -> bool:
        return self.swaps is not None and self.swaps.is_swapping_in(req_id)

    def on_pages(
        self, pages: KvPages, k: torch.Tensor, v: torch.Tensor, local: EngineScheduler
    ) -> None:
        """One fetched layer of a swap-in; when the last lands the request is local."""
        assert self.swaps is not None  # only called for a request swapping in
        move = self.swaps.on_pages(pages, k, v)
        if move is not None:
            self.kv_events.append(KvEvent("swapped_in", pages.req_id, 0, time.monotonic()))
            local.add_running(move.seq)

    def expired(self, now: float) -> list[str]:
        """Requests whose move did not finish within `SWAP_TIMEOUT_S`."""
        stalled = self.swaps.expired(now) if self.swaps else []
        for req_id in stalled:
            log.warning("KV swap stalled; ending its request", req_id=req_id)
        return stalled

    def moving(self) -> list[str]:
        return list(self.swaps.moving) if self.swaps else []

    def drop(self, req_id: str) -> None:
        if self.swaps is not None:
            self.swaps.drop(req_id)


def build_tier_policy(spec: str, runner: MeshModelRunner, num_shards: int) -> TierPolicy:
    """The policy `spec` names; Neo's (`neo`, `neo:<attention csv>`) over cost tables probed now
    on this engine's model and attention backend (T_ga, T_ca from the CSV when given)."""
    if not is_neo(spec):
        return tier_policy(spec)
    path = spec.partition(":")[2]
    try:
        costs = (
            read_costs(path, runner.model)
            if path
            else probe_costs(runner.model, runner.backend, num_shards)
        )
    except (OSError, ValueError, KeyError) as exc:  # a config error: the engine does not start
        raise ValueError(f"tier policy {spec!r}: no cost tables: {exc!r}") from exc
    t = costs.tables
    log.info("neo cost tables", source=path or "probe", linear=t.linear_s_by_tokens,
             local=t.local_attention_s_by_context,
             offload=t.offload_attention_s_by_context)  # fmt: skip
    return NeoTierPolicy(costs)


__all__ = ["SWAP_TIMEOUT_S", "KvTiers", "build_tier_policy"]
