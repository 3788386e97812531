"""The engine service: one class, three roles (Splitwise's prompt, token and mixed machines).

- prompt: FCFS prefill batches, the first token back to the router, the KV to the request's
  shard group or to its token engine (layer-wise for long prompts), then a `DecodeHandoff` to
  the token engine (`Prefill`, prefill_ship.py).
- token: continuous batching of handed-off requests (`DecodeAdmission`, admission.py); per
  layer, local attention for requests whose KV is local and one round trip per shard for the rest
  (`MeshModelRunner`, runner.py); Neo's two KV tiers move requests between them (`KvTiers`).
- mixed: both; a request whose token engine is this engine and has no shards never leaves it.

`Engine` is the coordinator: it owns no sockets and no per-request state of its own. Its parts
(built by parts.py) each own theirs: the requests (`RequestTable`), the prefill, the two
schedulers, decode admission, the KV tiers, the shards' KV news and the reports. Inputs arrive
through its `on_*` methods and its fault inputs (faults.py: what each one ends); `step()`
returns the messages to send as an `Outbox`, which `worker.py` sends.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch

from common.engine.core import sample_rows
from common.kv_ingress import Landed
from common.mesh_options import MeshOptions
from common.protocol import (
    DecodeHandoff,
    EngineStats,
    GenerateRequest,
    KvPages,
    KvRebuilt,
    KvSwapAck,
    LoadReport,
    RebuildKv,
    SetRole,
    ShardAddress,
    TokenOutput,
)
from common.roles import Role
from common.sampling import SampledRow
from common.scheduling.batching import Batch, Phase, Sequence
from services.engine import kv_news
from services.engine.kv_shipper import KvSend
from services.engine.outbox import Outbox
from services.engine.parts import EngineParts, build_engine_parts
from services.engine.prefill_chunks import PrefillStep
from services.engine.prefill_ship import free_shipped
from services.engine.requests import ShardRowFailed
from services.engine.routing import RequestRoute, kv_endpoints, placed_in, shard_of_rows


class Engine:
    """Prefill and/or decode for the mesh; see the module docstring."""

    def __init__(self, parts: EngineParts) -> None:
        self.parts = parts
        self.engine_id, self.role = parts.engine_id, parts.role
        self.table, self.prefill, self.tiers = parts.table, parts.prefill, parts.tiers
        self.runner, self.blocks, self.kv_ingress = parts.runner, parts.blocks, parts.kv_ingress
        self.ship_queue, self.local = parts.ship_queue, parts.local
        self.admission = parts.admission
        self.pool, self.telemetry, self.reports = parts.pool, parts.telemetry, parts.reports
        self.sampler, self.rebuilds = parts.sampler, parts.rebuilds
        self.chunks = parts.chunks
        self.steps = itertools.count()
        # Each request's output length at the last round of `_still_alive`, and when that was.
        self._lengths_at_round: dict[str, int] = {}
        self._alive_round_at = time.monotonic()

    @classmethod
    def build(cls, engine_id: str, role: Role, options: MeshOptions, model_path: str,
              kv_send: KvSend, **where: Any) -> Engine:  # fmt: skip
        """An engine of fresh parts (`build_engine_parts`: `where` names its endpoints, shard
        links and shards, and telemetry)."""
        return cls(build_engine_parts(engine_id, role, options, model_path, kv_send, **where))

    @property
    def shards(self) -> tuple[ShardAddress, ...]:
        """The shard group this engine decodes against, in head order (empty: none)."""
        return tuple(self.runner.shards)

    # -- inputs -----------------------------------------------------------------------------------

    def on_generate(self, msg: GenerateRequest) -> Outbox:
        """A new prompt. Invalid requests are answered with an error, never raised."""
        self.reports.received(msg.reply_to, prompt_tokens=len(msg.prompt_token_ids))
        try:
            req = self.table.add_prompt(msg)
        except ValueError as exc:
            return Outbox.output(msg.reply_to, TokenOutput(msg.req_id, [], "error", error=str(exc)))
        self.telemetry.on_prompt(msg.req_id, msg.traceparent)
        # Its tokens, to reuse a cached prefix; not when it wants every prompt position's logprobs.
        tokens = None if req.prompt_logprobs_wanted is not None else req.all_token_ids
        seq = Sequence(msg.req_id, len(req.all_token_ids), token_ids=tokens,
                       priority=req.params.priority)  # fmt: skip
        decode_here = msg.token_engine == self.parts.command_endpoint and not msg.shards
        (self.local if decode_here else self.ship_queue).add(seq)
        return Outbox()

    def on_handoff(self, msg: DecodeHandoff) -> Outbox:
        """A prefilled request to decode; it joins once its KV is in place."""
        self.reports.received(msg.reply_to, handoff=True)  # its room is counted here from now
        if self.kv_ingress.has_ended(msg.req_id):  # aborted, or its KV refused or expired here
            return self._refuse(msg, "no KV for the request")
        if msg.shards and not placed_in(msg.shards, self.shards):
            return self._refuse(msg, "its shard group changed")  # a shard left since placement
        try:
            self.table.add_handoff(msg)
        except ValueError as exc:
            self.kv_ingress.free(msg.req_id)
            return self._refuse(msg, str(exc), retryable=False)
        self.telemetry.on_handoff(msg.req_id, msg.traceparent)
        if not msg.shards:
            self.kv_ingress.claim(msg.req_id)  # this engine frees its KV from now on
        self.admission.add(msg, time.monotonic())
        return self.admit_handoffs()

    def on_rebuild(self, msg: RebuildKv) -> Outbox:
        """A token engine's lost shard heads to recompute (shard_rebuild.py): a prefill of the
        request's tokens whose KV ships to `msg.shards` only, answered with a `KvRebuilt`."""
        if msg.req_id in self.table:
            return _rebuilt(msg.reply_to, msg.req_id, self.why("the request is here already"))
        try:
            self.table.add_rebuild(msg)
        except ValueError as exc:
            return _rebuilt(msg.reply_to, msg.req_id, self.why(str(exc)))
        self.ship_queue.add(Sequence(msg.req_id, len(msg.token_ids), token_ids=msg.token_ids))
        return Outbox()

    def is_rebuild(self, req_id: str) -> bool:
        """Whether `req_id` here is a rebuild (`on_rebuild`). Its KV is pushed, never held for
        a pull: its token engine resumes the request once the KV has left, and a shard pulls
        only between steps (one of those steps would wait for it until `KV_WAIT_S`)."""
        route = self.table.routes.get(req_id)
        return route is not None and bool(route.rebuild_for)

    def on_kv(self, pages: KvPages, k: torch.Tensor, v: torch.Tensor) -> Outbox:
        """Local KV for a request this engine will decode (no shard group). KV that does not fit
        is refused: its request ends alone, retryable, and the engine goes on."""
        if self.tiers.is_swapping_in(pages.req_id):  # a shard's heads, coming back
            self.tiers.on_pages(pages, k, v, self.local)
            return Outbox()
        landed = self.kv_ingress.receive(pages, k, v)
        if landed is Landed.COMPLETE:
            return self.admit_handoffs()
        if landed is Landed.REFUSED and self.admission.waiting_for(pages.req_id) is not None:
            out = self.end(pages.req_id, self.why("no room for the request's KV"), retryable=True)
            return out + self.admit_handoffs()  # it may have been the head of the queue
        return Outbox()

    def on_swap_ack(self, ack: KvSwapAck) -> Outbox:
        """A shard has (or could not take, or serve) a request's swapped KV."""
        error = self.tiers.on_ack(ack, self.table, self.admission)
        return self.end(ack.req_id, self.why(error), retryable=True) if error else Outbox()

    def on_set_role(self, msg: SetRole) -> None:
        """A router lends this engine to the mixed pool, renews the lease, sends it home, or
        moves its home (its running requests stay: nothing here depends on the home)."""
        if msg.home is not None:
            self.pool.rehome(Role(msg.home))
            return
        loans = self.pool.num_loans
        self.pool.set(Role(msg.role), msg.lease_s, time.monotonic())
        if self.pool.num_loans > loans:  # a new loan, not a renewal: count it where it happens
            self.telemetry.metrics.count_pool_loan(str(self.pool.home))

    def on_abort(self, req_id: str) -> Outbox:
        """Forget a request wherever it is. The token engine decoding it frees its shards: only
        it knows when no decode step of the request can reach a shard any more."""
        self.telemetry.aborted(req_id)
        route = self.table.routes.get(req_id)
        moving = req_id in self.tiers.moving()  # either way, the shards may hold its KV
        frees = Outbox()
        if (self.admission.is_decoding_here(req_id) or moving) and route is not None:
            frees = Outbox.free(req_id, kv_endpoints(route.shards or self.shards))
        self.tiers.drop(req_id)
        self.rebuilds.rebuilding.discard(req_id)
        self.ship_queue.remove(req_id)
        self.local.remove(req_id)
        self.admission.remove(req_id)
        self.kv_ingress.free(req_id)  # its blocks, and a tombstone for anything still in flight
        self.table.pop(req_id)
        return frees

    # -- the loop ---------------------------------------------------------------------------------

    def has_work(self) -> bool:
        busy = self.ship_queue.num_unfinished or self.local.num_unfinished
        sharded = self.admission.sharded or self.admission.preempted
        return bool(busy or sharded) or self.admission.awaiting_landing()

    @torch.inference_mode()
    def step(self) -> Outbox:
        """One prefill step (prompts first, as Splitwise's mixed machines do; long ones a chunk a
        step, a decode step at least every chunk's worth) or decode step, after starting the KV
        swaps the tier policy plans (moving requests sit the step out)."""
        out = self.tiers.plan(self.table, self.local, self.admission, self.shards)
        if (prefill := self._next_prefill()) is not None:
            if prefill.is_chunk:
                self.prefill.run_chunk(prefill.batch, self.table)
            else:
                out += self._prefill_and_ship(prefill.batch)
        elif (batch := self.local.schedule()) is not None and batch.phase is Phase.PREFILL:
            out += self._emit_all(batch, self.prefill.run(batch, self.table))
            for seq in batch.seqs:  # new prompts decode here next (mixed role)
                self.telemetry.decode_started(seq.req_id)
        else:
            self.chunks.decoded()  # the decodes' turn, taken (prefill goes on next step)
            if self.admission.sharded:  # room on the group for this step's tokens
                out += self._preempted(self.admission.fit_growth(time.monotonic()))
            if batch is not None or self.admission.sharded:
                out += self._decode(batch)
            elif self.admission.awaiting_landing():  # nothing to run: ask the shards for news
                out += self._take_kv_news(*kv_news.ask(self.runner, next(self.steps)))
        if self.admission.waiting:  # requests may have finished: room for waiting hand-offs
            out += self.admit_handoffs()
        if self.admission.preempted:  # and for preempted ones
            out += self._resume()
        return out + self._still_alive()

    def _next_prefill(self) -> PrefillStep | None:
        """The next step of the prefills whose KV ships (prompts, recomputes, rebuilds), a chunk
        at a time when long (prefill_chunks.py); None when there is none, or when a decode step
        is owed: one chunk's worth of prefill ran since this engine's last decode step."""
        if self.chunks.decode_owed and (self.admission.sharded or self.local.num_unfinished):
            return None
        return self.chunks.next_step(self.ship_queue)

    def _still_alive(self) -> Outbox:
        """An empty output for each request held here that streamed nothing for a third of the
        router's progress deadline (`MeshOptions.progress_timeout_s`): it lives, and is not to
        be re-run. A preempted request waits for room; a running one waits behind prefill steps
        (recomputes, prompts to ship), which this engine runs before its decode steps."""
        now, every_s = time.monotonic(), self.parts.options.progress_timeout_s / 3
        quiet = set(self.admission.quiet(now, every_s))
        if now - self._alive_round_at >= every_s:
            lengths = {r: len(q.output_token_ids) for r, q in self.table.requests.items()}
            quiet.update(r for r, n in lengths.items() if self._lengths_at_round.get(r) == n)
            self._lengths_at_round, self._alive_round_at = lengths, now
        out = Outbox()
        for req_id in quiet:
            req, route = self.table.requests.get(req_id), self.table.routes.get(req_id)
            if req is None or route is None or route.rebuild_for:
                continue  # ended, or a rebuild's prefill: its token engine streams, not this one
            alive = TokenOutput(req_id, [], "", route.num_prompt_tokens,
                                index=len(req.output_token_ids))  # fmt: skip
            out += Outbox.output(route.reply_to, alive)
        return out

    def _preempted(self, req_ids: list[str]) -> Outbox:
        """Sharded requests preempted (admission.py): their KV on the shards is freed; each is
        recomputed from its tokens when room returns (`_resume`)."""
        out = Outbox()
        for req_id in req_ids:
            shards = kv_endpoints(self.table.routes[req_id].shards or self.shards)
            out += Outbox.free(req_id, shards, self.admission.kv_generation(req_id) - 1)
        return out

    def _resume(self) -> Outbox:
        """Preempted requests with room again go to the prefill queue (first in a step): their
        prompt and tokens so far are prefilled again here and shipped to the shards, then they
        decode on (`_prefill_and_ship`). Not a migration: the router sees a gap, not a loss."""
        resumed, preempted = self.admission.resumable(time.monotonic())
        for seq in resumed:
            tokens = self.table.requests[seq.req_id].all_token_ids
            self.ship_queue.add(Sequence(seq.req_id, len(tokens)))
        return self._preempted(preempted)

    def _prefill_and_ship(self, batch: Batch) -> Outbox:
        routes = {s.req_id: self.table.routes[s.req_id] for s in batch.seqs}
        resumes = {s.req_id for s in batch.seqs} & self.admission.resuming
        gens = {req_id: self.admission.kv_generation(req_id) for req_id in resumes}
        out = Outbox()
        sampled = self.prefill.run_and_ship(batch, self.table, gens)
        for seq, row in zip(batch.seqs, sampled, strict=True):
            if seq.req_id in self.admission.resuming:  # a preempted request: it decodes here
                out += self._emit(seq.req_id, row)
                self.admission.resumed(seq.req_id, seq.num_tokens + 1)
            else:
                out += self._shipped(seq.req_id, row, routes[seq.req_id])
            self.blocks.mark_computed(seq.req_id, seq.num_tokens)  # its prefix stays cached
            self.ship_queue.remove(seq.req_id)
        return out

    def _shipped(self, req_id: str, row: SampledRow, route: RequestRoute) -> Outbox:
        """A prefilled request whose KV left: its first token, then its hand-off (or, finished
        at that token, its shipped KV freed). A rebuild's token engine is told instead: no token
        goes out of a rebuild."""
        if route.rebuild_for:
            self.table.pop(req_id)
            return _rebuilt(route.rebuild_for, req_id)
        out = self._emit(req_id, row)
        handed = self.table.pop(req_id)  # still running: it decodes elsewhere
        return out + (self.prefill.hand_off(*handed) if handed else free_shipped(req_id, route))

    def _decode(self, batch: Batch | None) -> Outbox:
        local, sharded = batch.seqs if batch else [], list(self.admission.sharded)
        step = next(self.steps)
        trace = self.telemetry.trace_step(step, sharded)  # sampled: token.step, round trips
        plan = self.runner.plan_decode(
            local, sharded, self.table.token_ids(local + sharded), step, trace.traceparent,
            shard_of_rows(self.shards, self.table.routes, sharded), self.tiers.two_batch,
            trace_round_trips=trace.round_trips is not None,
        )  # fmt: skip
        self.telemetry.decode_step(len(local) + len(sharded), plan.batch_1 is not None)
        started = time.perf_counter()
        result = self.runner.run_decode(plan)
        reqs = [self.table.requests[s.req_id] for s in local + sharded]
        sampled = sample_rows(self.sampler, result.logits, reqs)
        self._step_timed(time.perf_counter() - started, plan.batch_1 is not None, bool(sharded))
        self.telemetry.step_done(trace, result.round_trips)
        out = self._emit_all(batch or Batch(Phase.DECODE, []), sampled[: len(local)])
        # A shard that could not grow, or hold, a request's KV: the request is preempted and
        # recomputed here, its token not taken (one preempted too often ends alone, retryably:
        # the router re-runs it elsewhere).
        regrown = [s.req_id for s in sharded if self.admission.recomputes(s.req_id, result.failed)]
        for req_id in regrown:
            self.admission.preempt(req_id, time.monotonic())
        out += self._preempted(regrown)
        self.admission.confirm([s.req_id for s in sharded if s.req_id not in result.failed])
        for seq, row in zip(sharded, sampled[len(local) :], strict=True):
            if seq.req_id in regrown:
                continue
            seq.num_computed, seq.num_tokens = seq.num_tokens, seq.num_tokens + 1
            if seq.req_id in result.failed:  # a shard could not attend for it: it alone re-runs
                row = SampledRow(ShardRowFailed(f"a shard of engine {self.engine_id} lost its KV"))
            out += self._emit(seq.req_id, row)
        news = kv_news.after(self.runner, self.admission, plan, result)
        return out + self._take_kv_news(*news)

    def _step_timed(self, measured_s: float, two_batches: bool, with_shards: bool) -> None:
        predicted = self.tiers.predicted_step_s
        if predicted is not None:
            self.telemetry.step_timed(predicted, measured_s, 2 if two_batches else int(with_shards))
            self.tiers.step_measured(measured_s)

    def _emit_all(self, batch: Batch, sampled: list[SampledRow]) -> Outbox:
        """Each row's token; then the local scheduler learns which of its requests finished."""
        out = Outbox()
        for seq, row in zip(batch.seqs, sampled, strict=True):
            out += self._emit(seq.req_id, row)
        self.local.update(batch, {s.req_id for s in batch.seqs if s.req_id not in self.table})
        return out

    def _emit(self, req_id: str, row: SampledRow) -> Outbox:
        """Stream a token; release a finished request, end a failed one alone."""
        emitted = self.table.emit(req_id, row)
        if emitted.output is None:
            return self.end(req_id, emitted.error, retryable=emitted.retryable)
        self.telemetry.token(req_id)
        out = Outbox.output(self.table.routes[req_id].reply_to, emitted.output)
        if emitted.finish_reason:
            self.telemetry.finished(req_id, emitted.finish_reason)
            _, route = self.table.pop(req_id) or (None, None)
            self.admission.remove(req_id)
            out += Outbox.free(req_id, kv_endpoints(route.shards if route else ()))
        return out

    def admit_handoffs(self) -> Outbox:
        """Start the hand-offs that may start; end, alone and retryably, the local ones that
        cannot fit while no room is coming (admission.py), so the queue behind them moves."""
        out, landed, whole_len = Outbox(), self.kv_ingress.is_complete, self.table.whole_len
        while True:
            for req_id in self.admission.admit(self.local, landed, whole_len):
                self.kv_ingress.forget(req_id)  # its blocks are the local scheduler's now
                self.telemetry.decode_started(req_id)
            room_coming = bool(self.local.num_unfinished or self.ship_queue.num_unfinished
                               or self.tiers.moving())  # fmt: skip
            refused = self.admission.unfittable(self.local, landed, whole_len, room_coming)
            if not refused:
                return out
            for h in refused:
                why = f"no room for the request's whole length ({whole_len(h.req_id)} tokens)"
                out += self.end(h.req_id, self.why(why), retryable=True)

    def _take_kv_news(self, landed: list[tuple[int, list[str]]], lost: set[str]) -> Outbox:
        """Shards' news of KV that landed (it may admit hand-offs) or was lost (its request ends,
        retryably: the router re-runs it)."""
        if not self.admission.await_landing:
            return Outbox()
        ended = kv_news.take(landed, lost, self.admission, self.shards)
        why = self.why("a shard lost the request's KV before it decoded")
        return self.end_all(ended, why) + self.admit_handoffs()

    # -- ends -------------------------------------------------------------------------------------

    def end(self, req_id: str, error: str, retryable: bool = False) -> Outbox:
        """End one request with an error to its client, and forget it here (frees included)."""
        route = self.table.routes[req_id]
        if route.rebuild_for:  # a rebuild has no client here: its token engine hears why
            return _rebuilt(route.rebuild_for, req_id, error) + self.on_abort(req_id)
        self.telemetry.aborted(req_id, RuntimeError(error))
        message = TokenOutput(req_id, [], "error", route.num_prompt_tokens, error=error,
                              retryable=retryable)  # fmt: skip
        return Outbox.output(route.reply_to, message) + self.on_abort(req_id)

    def end_all(self, req_ids: list[str], error: str) -> Outbox:
        """End each of `req_ids` retryably (the router re-runs them from their tokens)."""
        out = Outbox()
        for req_id in req_ids:
            out += self.end(req_id, error, retryable=True)
        return out

    def _refuse(self, handoff: DecodeHandoff, why: str, retryable: bool = True) -> Outbox:
        return Outbox.refusal(handoff, self.why(why), retryable)

    def why(self, what: str) -> str:
        return f"engine {self.engine_id}: {what}"

    # -- reports ----------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        stats = self.reports.stats(self.shards)
        stats.num_rebuilt = self.rebuilds.num_rebuilt
        stats.num_rebuild_fallbacks = self.rebuilds.num_fallbacks
        stats.num_prefill_chunks = self.chunks.num_chunks
        return stats

    def load_report(self, now: float) -> LoadReport:
        return self.reports.load_report(now, self.shards)


def _rebuilt(token_engine: str, req_id: str, error: str = "") -> Outbox:
    return Outbox(rebuilds=[(token_engine, KvRebuilt(req_id, error))])


__all__ = ["Engine"]
