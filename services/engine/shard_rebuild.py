"""A token engine's side of rebuilding a lost shard's heads (Lamina §5; the rules:
`common/scheduling/shard_rebuild.py`, the fault inputs that drive it: faults.py).

When a shard of its head-split group dies mid-step (`ShardLost`), the engine parks the group's
sharded requests (`DecodeAdmission.park`: out of the steps, reservations kept) and keeps its links
to the surviving shards, which keep their heads' KV (a shard frees what a closed link decoded).
When its keeper names the group again (`LinkShards`: the replacement in the lost slot, and the
live prompt engines), each parked request's tokens but its last go to a prompt engine
(`RebuildKv`): a full forward whose K/V leave for the replacement only, its heads only, as a
prefill's do (layer by layer for long ones), then a `KvRebuilt` back. The request then decodes
again where it was: no token is sampled from the rebuild, and its next step writes its last
token's KV on every shard. Its client sees a longer gap between two tokens, never an error.

What ends a parked request instead, retryably (the router's migration, the fallback):
- `plan_rebuild`'s rules: no replacement within `shard_rebuild_wait_s`, no prompt engine, a group
  that lost another shard or changed shape, a request-partitioned group;
- the prompt engine dies mid-rebuild: no `KvRebuilt` comes, and the bound ends the request; one
  that cannot compute or ship it (or that cannot be reached) says so, and the request ends then;
- the replacement or a survivor dies mid-rebuild (a `ShardLost`, or a new group from the keeper,
  while a rebuild is under way): every request of the group ends;
- a link fault (a late or stale reply) while the rebuild is under way: reconnecting the group
  frees the survivors' KV, so every parked request ends (`abandon_rebuild`);
- rebuilt KV that never lands on the replacement: the shard fails that row alone at its next step
  (`KV_WAIT_S`), retryably, as for any KV that did not land.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from common.protocol import RebuildKv, SamplingSpec, ShardAddress
from common.scheduling.shard_choice import holds_whole_requests
from common.scheduling.shard_rebuild import RebuildPlan, plan_rebuild
from services.engine.outbox import Outbox
from services.engine.requests import RequestTable
from services.engine.routing import kv_endpoints


@dataclass(frozen=True)
class LostShards:
    """A group that lost shards: its members when they died (slot order), the lost slots, and
    when (monotonic seconds)."""

    group: tuple[ShardAddress, ...]
    slots: frozenset[int]
    since: float


class ShardRebuilds:
    """The rebuild under way (at most one per engine: a second loss meanwhile migrates all)."""

    def __init__(self, bound_s: float) -> None:
        self.bound_s = bound_s  # `MeshOptions.shard_rebuild_wait_s`
        self.lost: LostShards | None = None
        self.onto: tuple[ShardAddress, ...] | None = None  # the group rebuilt onto, once chosen
        self.rebuilding: set[str] = set()  # `RebuildKv` sent, no `KvRebuilt` yet
        self.num_rebuilt = 0  # requests resumed on a rebuilt group, since start
        self.num_fallbacks = 0  # parked requests that migrated instead

    def held(self) -> list[ShardAddress]:
        """The surviving shards whose links must stay open while the rebuild is under way."""
        if self.lost is None:
            return []
        return [s for i, s in enumerate(self.lost.group) if i not in self.lost.slots]

    def first_plan(self, group: Seq[ShardAddress]) -> RebuildPlan:
        """Whether a group that just lost shards parks its requests (WAIT) or migrates them."""
        return plan_rebuild(
            kv_endpoints(group), frozenset(), (), head_split=not holds_whole_requests(group),
            num_rebuilders=0, waited_s=0.0, bound_s=self.bound_s,
        )  # fmt: skip

    def plan(self, group: Seq[ShardAddress], num_rebuilders: int, now: float) -> RebuildPlan:
        """The next move now that the keeper names `group` (empty: none whole yet)."""
        assert self.lost is not None
        lost = self.lost
        return plan_rebuild(
            kv_endpoints(lost.group), lost.slots, kv_endpoints(group),
            head_split=not holds_whole_requests(lost.group), num_rebuilders=num_rebuilders,
            waited_s=now - lost.since, bound_s=self.bound_s,
        )  # fmt: skip

    def overdue(self, now: float) -> bool:
        return self.lost is not None and now - self.lost.since >= self.bound_s

    def settle(self, parked: Iterable[str]) -> None:
        """Nothing parked any more (each resumed or ended): the rebuild is over."""
        if not any(True for _ in parked):
            self.lost, self.onto = None, None
            self.rebuilding.clear()


def rebuild_requests(
    req_ids: list[str],
    table: RequestTable,
    group: Seq[ShardAddress],
    targets: Seq[int],
    rebuilders: Seq[str],
    reply_to: str,
) -> Outbox:
    """A `RebuildKv` per request for the lost `targets` (slots of `group`), spread over the
    prompt engines `rebuilders`; each request's route names `group` from now on (its frees)."""
    out, dests = Outbox(), [group[slot] for slot in targets]
    for i, req_id in enumerate(req_ids):
        req = table.requests[req_id]
        table.routes[req_id].shards = tuple(group)
        tokens = req.all_token_ids[:-1]  # the last one's KV: its next decode step writes it
        # Greedy and plain: nothing is sampled for a client. `max_tokens` sizes the reservation.
        spec = SamplingSpec(max_tokens=req.params.max_tokens, temperature=0.0)
        num_prompt = min(len(req.prompt_token_ids), len(tokens))
        message = RebuildKv(req_id, tokens, num_prompt, spec, dests, reply_to)
        out.rebuilds.append((rebuilders[i % len(rebuilders)], message))
    return out


__all__ = ["LostShards", "ShardRebuilds", "rebuild_requests"]
