"""The engine's side of shard-pulled KV (`kv_transfer: pull`, Lamina §5): its shards' news about
KV arriving (`AttendResult.kv_landed`, `kv_lost`, on their replies; a `KvReadyQuery` round trip
when a shard had nothing to reply to) admits a waiting hand-off once every shard of its group has
its KV, and ends, retryably, one whose KV a shard lost (refused, or its pull failed: its prompt
engine died before the pull, or its hold's lease ran out); the router then re-runs it.

A mixin of `Engine` (engine.py); the state it acts on is the engine's (declared here).
"""

from __future__ import annotations

from common.protocol import ShardAddress
from services.engine.admission import DecodeAdmission
from services.engine.outbox import Outbox
from services.engine.runner import MeshModelRunner, StepPlan

# An idle token engine waiting for its shards' KV news lets each wait this long for some (the
# loop then asks again: no busy spin, and a landing is heard within this bound).
KV_NEWS_WAIT_S = 0.02


class EngineKvNews:
    engine_id: str
    admission: DecodeAdmission
    runner: MeshModelRunner
    shards: tuple[ShardAddress, ...]

    def _end(self, req_id: str, error: str, retryable: bool = False) -> Outbox:
        raise NotImplementedError  # EngineFaults'

    def _admit_handoffs(self) -> Outbox:
        raise NotImplementedError  # Engine's

    def _ask_kv_news(self, step: int) -> Outbox:
        """No step to run, hand-offs waiting for their KV: ask every shard."""
        return self._take_kv_news(*self.runner.ask_kv_news(step, KV_NEWS_WAIT_S))

    def _kv_news_after(self, plan: StepPlan) -> Outbox:
        """After a decode step: the news its replies carried, and that of the shards of a
        request-partitioned group that had no rows in it (asked, without waiting)."""
        rows = plan.sharded.shard_rows if plan.sharded else None
        if self.admission.awaiting_landing() and plan.sharded and rows:
            if idle := [i for i, mine in enumerate(rows) if not mine]:
                landed, lost = self.runner.ask_kv_news(plan.sharded.step, 0.0, idle)
                plan.kv_landed += landed
                plan.kv_lost |= lost
        return self._take_kv_news(plan.kv_landed, plan.kv_lost)

    def _take_kv_news(self, landed: list[tuple[int, list[str]]], lost: set[str]) -> Outbox:
        if not self.admission.await_landing:
            return Outbox()
        for i, req_ids in landed:
            self.admission.note_landed(self.shards[i].kv_endpoint, req_ids)
        out = Outbox()
        for req_id in lost:
            if self.admission.waiting_for(req_id) is not None:
                out += self._end(req_id, f"engine {self.engine_id}: a shard lost the request's "
                                 "KV before it decoded", retryable=True)  # fmt: skip
        return out + self._admit_handoffs()


__all__ = ["KV_NEWS_WAIT_S", "EngineKvNews"]
