"""The engine service: one class, three roles (Splitwise's prompt, token and mixed machines).

- prompt: FCFS prefill batches (2048-token cap), the first token back to the router, the KV to the
  request's shard group or to its token engine (layer-wise for long prompts, serialized for short
  ones), then a `DecodeHandoff` to the token engine.
- token: continuous batching of handed-off requests; per layer, local attention for requests whose
  KV is local and one round trip per shard for the rest (`MeshModelRunner`).
- mixed: both; a request whose token engine is this engine and has no shards never leaves it.

`Engine` owns no sockets: inputs arrive through its `on_*` methods, and `step()` returns the
messages to send as an `Outbox` (outbox.py). `worker.py` wires it to ZeroMQ
and UCX. Spans and metrics of its requests go through `self.telemetry` (`telemetry.py`).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Sequence as Seq
from pathlib import Path

import structlog
import torch

from common.config import EngineConfig
from common.engine.core import forward_and_sample
from common.engine.request import Request, check_prompt
from common.kv_ingress import KvIngress, Landed
from common.protocol import (
    DecodeHandoff,
    GenerateRequest,
    KvEvent,
    KvPages,
    SetRole,
    ShardAddress,
    TokenOutput,
)
from common.roles import Role
from common.sampling import SampledRow, Sampler, SamplingParams
from common.scheduling.batching import Batch, EngineScheduler, Phase, Sequence
from common.scheduling.role_lease import RoleLease
from common.scheduling.shard_choice import holds_whole_requests
from services.engine.admission import DecodeAdmission
from services.engine.faults import EngineFaults
from services.engine.kv_news import EngineKvNews
from services.engine.kv_shipper import KvSend
from services.engine.outbox import Outbox
from services.engine.parts import build_engine_parts
from services.engine.prefill_ship import EnginePrefillShip
from services.engine.reports import EngineReports
from services.engine.routing import (
    EngineRole,
    RequestRoute,
    kv_endpoints,
    placed_in,
    shard_of_rows,
)
from services.engine.runner import ShardLink, StepPlan
from services.engine.telemetry import EngineTelemetry
from services.engine.tiering import EngineTiering
from services.engine.token_output import EngineTokenOutput, ShardRowFailed

log = structlog.get_logger(__name__)


class Engine(
    EngineTiering, EngineFaults, EngineKvNews, EnginePrefillShip, EngineTokenOutput, EngineReports
):
    """Prefill and/or decode for the mesh; see the module docstring. Its parts, each a module:
    what its config builds (model, KV, runner; `parts.py`), its fault inputs (a lost router,
    undelivered KV or hand-offs, a failed step, a new shard group, expired waits; `faults.py`),
    its two KV tiers (local and the shard group, Neo; `tiering.py`), the prompt role's prefill,
    KV shipping and hand-off (`prefill_ship.py`), what becomes of a sampled token
    (`token_output.py`) and its stats and load reports (`reports.py`)."""

    def __init__(
        self,
        engine_id: str,
        role: EngineRole,
        config: EngineConfig,
        kv_send: KvSend,
        shard_links: Seq[ShardLink] = (),
        shards: Seq[ShardAddress] = (),
        telemetry: EngineTelemetry | None = None,
    ) -> None:
        self.engine_id, self.role = engine_id, role
        # The pool it serves in (home, or lent to mixed): what its reports say, what routers
        # place by. Every role runs the same code, so a change keeps all running requests.
        self.pool = RoleLease(Role(role.name))
        self.telemetry = telemetry or EngineTelemetry(engine_id, Path(config.model_path).name)
        parts = build_engine_parts(config, role, kv_send, shard_links, shards)
        self.model, self.blocks, self.runner = parts.model, parts.blocks, parts.runner
        self.grammars, self.sampler = parts.grammars, Sampler()
        # KV shipped here by prompt engines (no shard group); its tombstones are this engine's
        # memory of ended requests, so a hand-off or KV arriving after an abort is dropped.
        self.kv_ingress = KvIngress(self.blocks, parts.kv, keep_free=self._local_growth)
        self.shards = tuple(shards)  # the group the runner's links reach, in head order
        self.kv_send = kv_send
        # Prompts whose decode happens elsewhere (each leaves once its KV shipped), and requests
        # decoding here with local KV (which may be preempted and recomputed here). Both run the
        # simulator's mixed policy and share this engine's KV blocks.
        self.ship_queue = EngineScheduler(self.blocks, config.scheduler)
        self.local = EngineScheduler(self.blocks, config.scheduler)
        # Handoffs waiting for their KV, and the requests decoding against the shard group.
        # A request-partitioned group holds each request on one shard: its room is the sum.
        group_blocks = role.shard_num_blocks * (len(shards) if holds_whole_requests(shards) else 1)
        self.admission = DecodeAdmission(
            group_blocks, config.cache.block_size, await_landing=role.kv_transfer == "pull"
        )
        self.requests: dict[str, Request] = {}
        self.routing: dict[str, RequestRoute] = {}
        self.steps = itertools.count()
        self.max_model_len = self.model.config.max_position_embeddings
        self.kv_events: deque[KvEvent] = deque(maxlen=256)
        self.num_prefill_tokens = 0  # computed, i.e. not found in the prefix cache
        # Neo's local tier beside the shard group (parts.py builds its policy and swaps).
        self.local_kv_blocks, self.two_batch = role.local_kv_blocks, False
        self.tier_policy, self.swaps = parts.tier_policy, parts.swaps
        # Per decode step, the tier policy's predicted seconds (when it has a cost model: Neo)
        # and the measured ones, oldest first (the bench's predicted-vs-measured).
        self.predicted_step_s: float | None = None
        self.step_times: deque[tuple[float, float, int]] = deque(maxlen=4096)
        self.num_decode_steps = self.num_two_batch_steps = 0  # the schedules chosen (bench)
        self.num_group_relinks = 0  # shard group changes since start (a fault, a `LinkShards`)
        # `GenerateRequest`s received, by the router (`reply_to`) that sent them: each router's
        # placements its reports hold already (`LoadReport.received_requests`).
        self.received_requests: dict[str, int] = {}

    # -- inputs -----------------------------------------------------------------------------------

    def on_generate(self, msg: GenerateRequest) -> Outbox:
        """A new prompt. Invalid requests are answered with an error, never raised."""
        # Counted before it is checked: the router counts it placed whatever becomes of it.
        self.received_requests[msg.reply_to] = self.received_requests.get(msg.reply_to, 0) + 1
        try:
            params = SamplingParams.from_spec(msg.sampling)
            params.check_vocab(self.model.config.vocab_size)
            tokens = msg.prompt_token_ids + msg.output_token_ids
            check_prompt(tokens, self.model.config.vocab_size, self.max_model_len)
            # A migrated request's grammar replays the tokens it already streamed.
            grammar = self.grammars.matcher(params, msg.output_token_ids)
        except ValueError as exc:
            return Outbox.output(msg.reply_to, TokenOutput(msg.req_id, [], "error", error=str(exc)))
        # A migrated request brings the tokens it already streamed: they are output (finish
        # rules count them) and the prefill covers them, so the next token continues the stream.
        self.requests[msg.req_id] = Request(
            msg.req_id, list(msg.prompt_token_ids), params, self.model.config.eos_token_ids,
            self.max_model_len, output_token_ids=list(msg.output_token_ids), grammar=grammar,
        )  # fmt: skip
        self.routing[msg.req_id] = RequestRoute(
            msg.reply_to, msg.token_engine, msg.token_kv_endpoint, msg.token_kv_address,
            tuple(msg.shards), len(msg.prompt_token_ids),
        )  # fmt: skip
        self.telemetry.on_prompt(msg.req_id, msg.traceparent)
        # Its tokens, to reuse a cached prefix; not when it wants every prompt position's logprobs.
        wants_all = self.requests[msg.req_id].prompt_logprobs_wanted is not None
        reusable = None if wants_all else tokens
        seq = Sequence(msg.req_id, len(tokens), token_ids=reusable)
        decode_here = msg.token_engine == self.role.command_endpoint and not msg.shards
        (self.local if decode_here else self.ship_queue).add(seq)
        return Outbox()

    def on_handoff(self, msg: DecodeHandoff) -> Outbox:
        """A prefilled request to decode; it joins once its KV is in place."""
        if self.kv_ingress.has_ended(msg.req_id):  # aborted, or its KV refused or expired here
            return self._refuse_handoff(msg, "no KV for the request")
        if msg.shards and not placed_in(msg.shards, self.shards):
            # Placed while this engine's group was whole; a shard has left since.
            return self._refuse_handoff(msg, "its shard group changed")
        output_token_ids = msg.token_ids[msg.num_prompt_tokens :]
        params = SamplingParams.from_spec(msg.sampling)
        try:  # the prompt engine's grammar state, rebuilt from the tokens it sampled
            grammar = self.grammars.matcher(params, output_token_ids)
        except ValueError as exc:  # the request's fault: re-running it elsewhere would not help
            self.kv_ingress.free(msg.req_id)
            return self._refuse_handoff(msg, str(exc), retryable=False)
        self.requests[msg.req_id] = Request(
            msg.req_id, msg.token_ids[: msg.num_prompt_tokens], params,
            self.model.config.eos_token_ids, self.max_model_len,
            output_token_ids=output_token_ids, grammar=grammar,
        )  # fmt: skip
        self.routing[msg.req_id] = RequestRoute(
            msg.reply_to, shards=tuple(msg.shards), num_prompt_tokens=msg.num_prompt_tokens
        )
        self.telemetry.on_handoff(msg.req_id, msg.traceparent)
        if not msg.shards:
            self.kv_ingress.claim(msg.req_id)  # this engine frees its KV from now on
        self.admission.add(msg, time.monotonic())
        return self._admit_handoffs()

    def on_kv(self, pages: KvPages, k: torch.Tensor, v: torch.Tensor) -> Outbox:
        """Local KV for a request this engine will decode (no shard group). KV that does not fit
        is refused: its request ends alone, retryable, and the engine goes on."""
        if self.swaps is not None and self.swaps.is_swapping_in(pages.req_id):
            return self._on_swap_pages(pages, k, v)  # a shard's heads, coming back
        landed = self.kv_ingress.receive(pages, k, v)
        if landed is Landed.COMPLETE:
            return self._admit_handoffs()
        if landed is Landed.REFUSED and self.admission.waiting_for(pages.req_id) is not None:
            out = self._end(pages.req_id, f"engine {self.engine_id}: no room for the "
                            "request's KV", retryable=True)  # fmt: skip
            return out + self._admit_handoffs()  # it may have been the head of the queue
        return Outbox()

    def on_set_role(self, msg: SetRole) -> None:
        """A router lends this engine to the mixed pool, renews the lease, or sends it home."""
        loans = self.pool.num_loans
        self.pool.set(Role(msg.role), msg.lease_s, time.monotonic())
        if self.pool.num_loans > loans:  # a new loan, not a renewal: count it where it happens
            self.telemetry.metrics.count_pool_loan(str(self.pool.home))

    def on_abort(self, req_id: str) -> Outbox:
        """Forget a request wherever it is. The token engine decoding it frees its shards: only
        it knows when no decode step of the request can reach a shard any more."""
        self.telemetry.aborted(req_id)
        route = self.routing.get(req_id)
        frees = Outbox()
        moving = req_id in self._moving()  # either way, the shards may hold its KV
        if (self.admission.is_decoding_here(req_id) or moving) and route is not None:
            frees = Outbox.free(req_id, kv_endpoints(route.shards or self.shards))
        if moving and self.swaps is not None:
            self.swaps.drop(req_id)
        self.ship_queue.remove(req_id)
        self.local.remove(req_id)
        self.admission.remove(req_id)
        self.kv_ingress.free(req_id)  # its blocks, and a tombstone for anything still in flight
        self.requests.pop(req_id, None)
        self.routing.pop(req_id, None)
        return frees

    # -- the loop ---------------------------------------------------------------------------------

    def has_work(self) -> bool:
        busy = self.ship_queue.num_unfinished or self.local.num_unfinished
        return bool(busy or self.admission.sharded) or self.admission.awaiting_landing()

    @torch.inference_mode()
    def step(self) -> Outbox:
        """One prefill batch (prompts first, as Splitwise's mixed machines do) or decode step,
        after starting the KV swaps the tier policy plans (moving requests sit the step out)."""
        moves = self._plan_tiers()
        out = moves + self._step_batch()
        if self.admission.waiting:  # requests may have finished: room for waiting hand-offs
            out += self._admit_handoffs()
        return out

    def _step_batch(self) -> Outbox:
        batch = self.ship_queue.schedule()
        if batch is not None:
            return self._prefill_and_ship(batch)
        batch = self.local.schedule()
        if batch is not None and batch.phase is Phase.PREFILL:
            return self._run_local(batch)
        local = batch.seqs if batch else []
        if not local and not self.admission.sharded:
            if self.admission.awaiting_landing():  # nothing to run: ask the shards for news
                return self._ask_kv_news(next(self.steps))
            return Outbox()
        return self._decode(batch, local)

    def _run_local(self, batch: Batch) -> Outbox:
        start_ns = self.telemetry.prefill_started(s.req_id for s in batch.seqs)
        self.num_prefill_tokens += batch.num_tokens
        sampled = self._forward(batch, self.runner.plan_prefill(batch, self._token_ids(batch)))
        self.telemetry.prefill_done(batch.seqs, start_ns, time.time_ns())
        out = self._finish_step(batch, sampled)
        for seq in batch.seqs:  # new prompts decode here next (mixed role)
            self.telemetry.decode_started(seq.req_id)
        return out

    def _decode(self, batch: Batch | None, local: list[Sequence]) -> Outbox:
        sharded = list(self.admission.sharded)
        token_ids = {s.req_id: self.requests[s.req_id].all_token_ids for s in local + sharded}
        self.admission.grow_sharded()
        step = next(self.steps)
        trace = self.telemetry.trace_step(step, sharded)  # sampled: token.step, round trips
        shard_of = shard_of_rows(self.shards, self.routing, sharded)  # request-partitioned
        if self.two_batch and local and sharded:  # batch-0 local, batch-1 offloaded (Neo)
            plan = self.runner.plan_decode(local, [], token_ids, step)
            plan.batch_1 = self.runner.plan_decode(
                [], sharded, token_ids, step, trace.round_trips, trace.traceparent, shard_of
            )
            # One set of outcomes for the step, whichever sub-batch saw them.
            plan.batch_1.failed, plan.batch_1.kv_landed = plan.failed, plan.kv_landed
            plan.batch_1.kv_lost = plan.kv_lost
            self.num_two_batch_steps += 1
        else:
            plan = self.runner.plan_decode(local, sharded, token_ids, step, trace.round_trips,
                                           trace.traceparent, shard_of)  # fmt: skip
        self.num_decode_steps += 1
        everyone = Batch(Phase.DECODE, local + sharded)
        self.telemetry.decode_step(len(everyone.seqs))
        started = time.perf_counter()
        sampled = self._forward(everyone, plan)
        if self.predicted_step_s is not None:
            kind = 2 if plan.batch_1 is not None else int(bool(sharded))
            self._step_measured(time.perf_counter() - started, kind)
        self.telemetry.step_done(trace)
        out = self._finish_step(batch or Batch(Phase.DECODE, []), sampled[: len(local)])
        self.admission.confirm([s.req_id for s in sharded if s.req_id not in plan.failed])
        for seq, row in zip(sharded, sampled[len(local) :], strict=True):
            seq.num_computed, seq.num_tokens = seq.num_tokens, seq.num_tokens + 1
            if seq.req_id in plan.failed:  # a shard could not attend for it: it alone is re-run
                row = SampledRow(ShardRowFailed(f"a shard of engine {self.engine_id} lost its KV"))
            out += self._emit(seq.req_id, row)
        return out + self._kv_news_after(plan)

    def _forward(self, batch: Batch, plan: StepPlan) -> list[SampledRow]:
        """The batch's next tokens (a row whose sampling failed carries the exception instead),
        their logprobs and, after a prefill, the prompts' (for the requests that ask)."""
        reqs = [self.requests[s.req_id] for s in batch.seqs]
        return forward_and_sample(self.runner, self.sampler, plan, reqs, batch.phase)

    def _finish_step(self, batch: Batch, sampled: list[SampledRow]) -> Outbox:
        out = Outbox()
        for seq, row in zip(batch.seqs, sampled, strict=True):
            out += self._emit(seq.req_id, row)
        finished = {s.req_id for s in batch.seqs if s.req_id not in self.requests}
        self.local.update(batch, finished)
        return out

    # -- per-request bookkeeping ------------------------------------------------------------------

    def _admit_handoffs(self) -> Outbox:
        """Start the hand-offs that may start; end, alone and retryably, the local ones that
        cannot fit while no room is coming (admission.py), so the queue behind them moves."""
        out = Outbox()
        while True:
            for req_id in self.admission.admit(
                self.local, self.kv_ingress.is_complete, self._max_len
            ):
                self.kv_ingress.forget(req_id)  # its blocks are the local scheduler's now
                self.telemetry.decode_started(req_id)
            room_coming = bool(
                self.local.num_unfinished or self.ship_queue.num_unfinished or self._moving()
            )
            refused = self.admission.unfittable(
                self.local, self.kv_ingress.is_complete, self._max_len, room_coming
            )
            if not refused:
                return out
            for h in refused:
                out += self._end(h.req_id, f"engine {self.engine_id}: no room for the "
                                 f"request's whole length ({self._max_len(h.req_id)} tokens)",
                                 retryable=True)  # fmt: skip

    def _local_growth(self) -> int:
        """Blocks the local requests may still take, each up to its whole length: landing KV
        and new hand-offs leave them free, so no local decode step runs out of blocks."""
        return self.local.blocks_to_grow(self._max_len)

    def _max_len(self, req_id: str) -> int:
        return self._whole_len(req_id) if req_id in self.requests else 0

    def _token_ids(self, batch: Batch) -> dict[str, list[int]]:
        return {s.req_id: self.requests[s.req_id].all_token_ids for s in batch.seqs}
