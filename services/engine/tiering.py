"""The engine's two KV tiers (Neo §3): each iteration a `TierPolicy` (common/scheduling/tiers.py)
says which decode requests move between the local tier and the shard group; `KvSwaps`
(tiers.py) moves them; this mixin of `Engine` (engine.py) feeds the policy and turns finished
moves into scheduling: a swapped-in request joins the local scheduler (its shards dropped their
copies when they sent them), a swapped-out one joins the sharded rows. A failed or stalled move
ends its request alone, retryably (the router re-runs it from its tokens), freeing both tiers'
copies.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

import structlog
import torch

from common.block_manager import BlockManager, NoFreeBlocksError
from common.engine.request import Request
from common.protocol import KvEvent, KvPages, KvSwapAck, ShardAddress
from common.scheduling.batching import EngineScheduler
from common.scheduling.neo_tiers import NeoTierPolicy
from common.scheduling.tiers import Tier, TierPolicy, TierRequest, TierState, is_neo, tier_policy
from services.engine.admission import DecodeAdmission
from services.engine.cost_probe import EngineNeoCosts, probe_costs, read_costs
from services.engine.outbox import Outbox
from services.engine.routing import RequestRoute
from services.engine.runner import MeshModelRunner
from services.engine.tiers import SWAP_TIMEOUT_S, KvSwaps, SwapFailed

log = structlog.get_logger(__name__)


class EngineTiering:
    """`Engine`'s tier inputs; the state they act on is the engine's (declared here)."""

    engine_id: str
    requests: dict[str, Request]
    routing: dict[str, RequestRoute]
    admission: DecodeAdmission
    local: EngineScheduler
    blocks: BlockManager
    shards: tuple[ShardAddress, ...]
    swaps: KvSwaps | None  # None: one tier (no local budget, or no KV listener for replies)
    tier_policy: TierPolicy
    local_kv_blocks: int
    max_model_len: int
    runner: MeshModelRunner
    kv_events: deque[KvEvent]  # `swapped_in` / `swapped_out` as each move finishes
    two_batch: bool  # the policy's choice for this iteration's decode (asymmetric pipelining)
    predicted_step_s: float | None  # the policy's estimate of this iteration's decode step
    step_times: deque[tuple[float, float, int]]  # (predicted, measured, kind) per decode step

    if TYPE_CHECKING:  # EngineFaults' (after this mixin in Engine's bases: no stub here)

        def _end(self, req_id: str, error: str, retryable: bool = False) -> Outbox: ...

    def _step_measured(self, measured_s: float, kind: int) -> None:
        """A decode step the policy predicted ran (`kind`: 0 local only, 1 with shards, 2 two
        sub-batches): kept for the bench, and fed back to a Neo cost model's step overhead."""
        assert self.predicted_step_s is not None
        self.step_times.append((self.predicted_step_s, measured_s, kind))
        if isinstance(self.tier_policy, NeoTierPolicy) and isinstance(
            costs := self.tier_policy.costs, EngineNeoCosts
        ):
            costs.observe_step(self.predicted_step_s, measured_s)

    def _plan_tiers(self) -> Outbox:
        """Between steps: start the swaps the policy plans (the fetches to send, for swap-ins)."""
        swaps = self.swaps
        self.predicted_step_s = None  # no plan, no prediction
        if swaps is None or not self.shards or self.local.plan_in_progress:
            return Outbox()
        state = TierState(self._tier_requests(swaps), self.local_kv_blocks, self.blocks.block_size)
        if isinstance(self.tier_policy, NeoTierPolicy) and isinstance(
            costs := self.tier_policy.costs, EngineNeoCosts
        ):  # T_ca's round trip, as this engine's sharded steps measured it
            times = self.runner.times  # `two_batch` is still the step just run's
            costs.observe(times.num_steps, times.network_s, overlapped=self.two_batch)
        plan = self.tier_policy.plan(state)
        self.two_batch = plan.two_batch
        self.predicted_step_s = plan.predicted_step_s
        now, out = time.monotonic(), Outbox()
        running = {s.req_id: s for s in self.local.running}
        for req_id in plan.swap_out:
            if req_id in running and req_id in self.requests:
                self.local.detach(req_id)
                swaps.swap_out(running[req_id], self.shards, self._whole_len(req_id), now)
        sharded = {s.req_id: s for s in self.admission.sharded}
        for req_id in plan.swap_in:
            if req_id not in sharded:
                continue
            try:
                out += swaps.swap_in(sharded[req_id], self.shards, now)
            except NoFreeBlocksError:  # the budget is larger than the cache: it stays offloaded
                continue
            self.admission.remove(req_id)  # out of the sharded rows; its mirror room back
        return out

    def _tier_requests(self, swaps: KvSwaps) -> list[TierRequest]:
        tiers = [(s, Tier.LOCAL) for s in self.local.running]
        arriving = self.admission.arriving  # KV still landing on the shards: not movable yet
        tiers += [
            (s, Tier.ARRIVING if s.req_id in arriving else Tier.OFFLOADED)
            for s in self.admission.sharded
        ]
        tiers += [(m.seq, Tier.MOVING) for m in swaps.moving.values()]
        return [
            TierRequest(s.req_id, tier, s.num_tokens,
                        len(self.requests[s.req_id].output_token_ids), self._whole_len(s.req_id))
            for s, tier in tiers if s.req_id in self.requests
        ]  # fmt: skip

    def _whole_len(self, req_id: str) -> int:
        """The most tokens `req_id` may hold: what each tier reserves for it."""
        req = self.requests[req_id]
        return min(len(req.prompt_token_ids) + req.params.max_tokens, self.max_model_len)

    def on_swap_ack(self, ack: KvSwapAck) -> Outbox:
        """A shard has (or could not take, or serve) a request's swapped KV."""
        if self.swaps is None:
            return Outbox()
        try:
            move = self.swaps.on_ack(ack)
        except SwapFailed as exc:
            if ack.req_id not in self.routing:
                return Outbox()
            return self._end(ack.req_id, f"engine {self.engine_id}: {exc}", retryable=True)
        if move is not None:
            self.kv_events.append(KvEvent("swapped_out", ack.req_id, 0, time.monotonic()))
            self.admission.add_sharded(move.seq, move.reserve_tokens)
            # It may have come with local KV (no shards in its route): they free it from now on.
            self.routing[ack.req_id].shards = move.shards
        return Outbox()

    def _on_swap_pages(self, pages: KvPages, k: torch.Tensor, v: torch.Tensor) -> Outbox:
        """One fetched layer of a swap-in; when the last lands the request is local."""
        assert self.swaps is not None  # only called for a request swapping in
        move = self.swaps.on_pages(pages, k, v)
        if move is not None:
            self.kv_events.append(KvEvent("swapped_in", pages.req_id, 0, time.monotonic()))
            self.local.add_running(move.seq)
        return Outbox()

    def _expire_swaps(self, now: float) -> Outbox:
        out = Outbox()
        for req_id in self.swaps.expired(now) if self.swaps else []:
            log.warning("KV swap stalled; ending its request", engine=self.engine_id,
                        req_id=req_id)  # fmt: skip
            out += self._end(req_id, f"engine {self.engine_id}: its KV swap did not finish "
                             f"within {SWAP_TIMEOUT_S} s", retryable=True)  # fmt: skip
        return out

    def _moving(self) -> list[str]:
        return list(self.swaps.moving) if self.swaps else []


def build_tier_policy(spec: str, runner: MeshModelRunner, num_shards: int) -> TierPolicy:
    """The policy `spec` names; Neo's (`neo`, `neo:<attention csv>`) over cost tables measured
    now on this engine's model and attention backend (T_ga, T_ca from the CSV when given)."""
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


__all__ = ["EngineTiering", "build_tier_policy"]
