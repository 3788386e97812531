"""A token engine's side of shard-pulled KV (`kv_transfer: pull`, Lamina §5): its shards' news
about KV arriving (`AttendResult.kv_landed`, `kv_lost`, on their replies; a `KvReadyQuery` round
trip when a shard had nothing to reply to). A waiting hand-off is admitted once every shard of
its group has its KV; one whose KV a shard lost (refused, or its pull failed: its prompt engine
died before the pull, or its hold's lease ran out) ends retryably, and the router re-runs it.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from common.protocol import ShardAddress
from services.engine.admission import DecodeAdmission
from services.engine.runner import MeshModelRunner, StepPlan, StepResult

# An idle token engine waiting for its shards' KV news lets each wait this long for some (the
# loop then asks again: no busy spin, and a landing is heard within this bound).
KV_NEWS_WAIT_S = 0.02

News = tuple[list[tuple[int, list[str]]], set[str]]  # (shard index, landed req ids), lost req ids


def ask(runner: MeshModelRunner, step: int) -> News:
    """No step to run, hand-offs waiting for their KV: ask every shard."""
    return runner.ask_kv_news(step, KV_NEWS_WAIT_S)


def after(
    runner: MeshModelRunner, admission: DecodeAdmission, plan: StepPlan, result: StepResult
) -> News:
    """After a decode step: the news its replies carried, and that of the shards of a
    request-partitioned group that had no rows in it (asked, without waiting)."""
    landed, lost = list(result.kv_landed), set(result.kv_lost)
    rows = plan.sharded.shard_rows if plan.sharded else None
    if admission.awaiting_landing() and plan.sharded and rows:
        if idle := [i for i, mine in enumerate(rows) if not mine]:
            more_landed, more_lost = runner.ask_kv_news(plan.sharded.step, 0.0, idle)
            landed, lost = landed + more_landed, lost | more_lost
    return landed, lost


def take(
    landed: list[tuple[int, list[str]]],
    lost: set[str],
    admission: DecodeAdmission,
    shards: Seq[ShardAddress],
) -> list[str]:
    """Note what landed where; the waiting hand-offs whose KV a shard lost (to end)."""
    for i, req_ids in landed:
        admission.note_landed(shards[i].kv_endpoint, req_ids)
    return [req_id for req_id in lost if admission.waiting_for(req_id) is not None]


__all__ = ["KV_NEWS_WAIT_S", "News", "after", "ask", "take"]
