"""Rebuild or migrate: what a token engine does with its requests when a shard of its group dies
(Lamina §5: a dead attention worker's KV is recomputed from the tokens).

In a head-split group every shard holds a slice of KV heads of every request, so a dead shard
loses those heads for all of them and nothing else. The surviving shards keep theirs; once a
replacement holds the lost slot, a prompt engine recomputes the request's KV from its tokens and
ships only the lost heads to it, and decoding goes on. Where that cannot be, the requests end
retryably and the router re-runs them elsewhere (migration, the fallback).

Pure: plain state in, a decision out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


class RebuildChoice(Enum):
    WAIT = "wait"  # no replacement yet: the requests stay parked
    REBUILD = "rebuild"  # recompute the lost heads on `targets`
    MIGRATE = "migrate"  # end the requests retryably: the router re-runs them


@dataclass(frozen=True)
class RebuildPlan:
    choice: RebuildChoice
    targets: tuple[int, ...] = ()  # slots of the new group to rebuild (the lost ones)
    reason: str = ""  # why migrate


def plan_rebuild(
    old_group: Sequence[str],
    lost: frozenset[int],
    new_group: Sequence[str],
    *,
    head_split: bool,
    num_rebuilders: int,
    waited_s: float,
    bound_s: float,
) -> RebuildPlan:
    """The next move for requests parked since a shard of `old_group` died.

    Groups are their members' KV endpoints in slot (head) order; `lost` the slots of
    `old_group` whose shard died; `new_group` the group the engine is told to link to now (empty:
    none whole yet). Rules, in order: a request-partitioned group holds whole requests, so a
    dead shard leaves nothing to rebuild from (migrate); `bound_s` 0 (rebuild off), or
    `waited_s` past it (migrate); no group yet (wait); a group of another shape, or one that
    lacks a survivor (a second shard was lost: its heads are gone too), or one where a lost
    slot kept the dead shard (migrate); no prompt engine to recompute (migrate); else rebuild
    the lost slots.
    """
    if not head_split:
        return _migrate("its shard group holds whole requests: nothing survives to rebuild on")
    if bound_s == 0:
        return _migrate("shard rebuild is off (shard_rebuild_wait_s 0)")
    if waited_s >= bound_s:
        return _migrate(f"no replacement shard within {bound_s} s")
    if not new_group:
        return RebuildPlan(RebuildChoice.WAIT)
    if len(new_group) != len(old_group):
        return _migrate("its shard group changed shape")
    for slot, (old, new) in enumerate(zip(old_group, new_group, strict=True)):
        if (slot in lost) == (old == new):
            return _migrate("another shard of its group changed too")
    if num_rebuilders == 0:
        return _migrate("no prompt engine to rebuild its lost heads")
    return RebuildPlan(RebuildChoice.REBUILD, tuple(sorted(lost)))


def _migrate(reason: str) -> RebuildPlan:
    return RebuildPlan(RebuildChoice.MIGRATE, reason=reason)


__all__ = ["RebuildChoice", "RebuildPlan", "plan_rebuild"]
