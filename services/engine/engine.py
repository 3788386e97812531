"""The engine service: one class, three roles (Splitwise's prompt, token and mixed machines).

- prompt: FCFS prefill batches (2048-token cap), the first token back to the router, the KV to the
  request's shard group or to its token engine (layer-wise for long prompts, serialized for short
  ones), then a `DecodeHandoff` to the token engine.
- token: continuous batching of handed-off requests; per layer, local attention for requests whose
  KV is local and one round trip per shard for the rest (`MeshModelRunner`).
- mixed: both; a request whose token engine is this engine and has no shards never leaves it.

`Engine` owns no sockets: inputs arrive through its `on_*` methods, and `step()` returns the
messages to send as `(endpoint, message)` pairs. `worker.py` wires it to ZeroMQ
and UCX. Spans and metrics of its requests go through `self.telemetry` (`telemetry.py`).
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Sequence as Seq
from pathlib import Path

import structlog
import torch

from common.attention import select_backend
from common.block_manager import BlockManager
from common.config import EngineConfig
from common.engine.request import Request, check_prompt
from common.kv_cache import KVCache
from common.model.loader import load_model
from common.protocol import (
    DecodeHandoff,
    EngineStats,
    FreeRequest,
    GenerateRequest,
    KvEvent,
    KvPages,
    LoadReport,
    ShardAddress,
    TokenOutput,
)
from common.sampling import Sampler, SamplingParams
from common.scheduling.batching import Batch, BatchScheduler, Phase, Sequence
from services.engine.admission import DecodeAdmission
from services.engine.routing import EngineRole, RequestRoute, kv_endpoints
from services.engine.runner import KvRoute, KvSend, KvShipper, MeshModelRunner, ShardLink
from services.engine.telemetry import EngineTelemetry

log = structlog.get_logger(__name__)

Outgoing = list[tuple[str, object]]  # (endpoint, control message)
_TOMBSTONES = 4096


class Engine:
    """Prefill and/or decode for the mesh; see the module docstring."""

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
        self.telemetry = telemetry or EngineTelemetry(engine_id, Path(config.model_path).name)
        self.model = load_model(config.model_path, config.dtype)
        mc = self.model.config
        c = config.cache
        self.blocks = BlockManager(c.num_blocks, c.block_size)
        kv = KVCache(
            mc.num_hidden_layers, c.num_blocks, c.block_size, mc.num_key_value_heads,
            mc.head_dim, getattr(torch, mc.dtype),
        )  # fmt: skip
        self.runner = MeshModelRunner(
            self.model, kv, self.blocks, select_backend(config.attention_backend),
            shard_links=shard_links, head_ranges=[(s.head_start, s.head_end) for s in shards],
        )  # fmt: skip
        self.shards = tuple(shards)  # the group the runner's links reach, in head order
        self.kv_send = kv_send
        # Prompts whose decode happens elsewhere, and requests decoding here with local KV
        # (which may be preempted and recomputed here). Both share this engine's KV blocks.
        self.ship_queue = BatchScheduler(self.blocks, config.scheduler, prefill=True, decode=False)
        self.local = BatchScheduler(self.blocks, config.scheduler, prefill=True, decode=True)
        # Handoffs waiting for their KV, and the requests decoding against the shard group.
        self.admission = DecodeAdmission(role.shard_num_blocks, c.block_size)
        self.requests: dict[str, Request] = {}
        self.routing: dict[str, RequestRoute] = {}
        self.sampler = Sampler()
        self.steps = itertools.count()
        self.max_model_len = mc.max_position_embeddings
        # Aborted ids, so that a handoff or KV arriving after the abort is dropped, not leaked.
        self.aborted: OrderedDict[str, None] = OrderedDict()
        self.kv_events: deque[KvEvent] = deque(maxlen=256)

    # -- inputs -----------------------------------------------------------------------------------

    def on_generate(self, msg: GenerateRequest) -> Outgoing:
        """A new prompt. Invalid requests are answered with an error, never raised."""
        try:
            params = SamplingParams.from_spec(msg.sampling)
            tokens = msg.prompt_token_ids + msg.output_token_ids
            check_prompt(tokens, self.model.config.vocab_size, self.max_model_len)
        except ValueError as exc:
            return [(msg.reply_to, TokenOutput(msg.req_id, [], "error", error=str(exc)))]
        # A migrated request brings the tokens it already streamed: they are output (finish
        # rules count them) and the prefill covers them, so the next token continues the stream.
        self.requests[msg.req_id] = Request(
            msg.req_id, list(msg.prompt_token_ids), params, self.model.config.eos_token_ids,
            self.max_model_len, output_token_ids=list(msg.output_token_ids),
        )  # fmt: skip
        self.routing[msg.req_id] = RequestRoute(
            msg.reply_to, msg.token_engine, msg.token_kv_endpoint, tuple(msg.shards),
            len(msg.prompt_token_ids),
        )  # fmt: skip
        self.telemetry.on_prompt(msg.req_id, msg.traceparent)
        seq = Sequence(msg.req_id, len(msg.prompt_token_ids) + len(msg.output_token_ids))
        decode_here = msg.token_engine == self.role.command_endpoint and not msg.shards
        (self.local if decode_here else self.ship_queue).add(seq)
        return []

    def on_handoff(self, msg: DecodeHandoff) -> Outgoing:
        """A prefilled request to decode; it joins once its KV is in place."""
        if msg.req_id in self.aborted:
            return [(s.kv_endpoint, FreeRequest(msg.req_id)) for s in msg.shards]
        if msg.shards and kv_endpoints(msg.shards) != kv_endpoints(self.shards):
            # Placed while this engine's group was whole; a shard has left since.
            stale = TokenOutput(msg.req_id, [], "error", error=f"engine {self.engine_id}: its "
                                "shard group changed", retryable=True)  # fmt: skip
            frees = [(s.kv_endpoint, FreeRequest(msg.req_id)) for s in msg.shards]
            return [(msg.reply_to, stale), *frees]
        self.requests[msg.req_id] = Request(
            msg.req_id, msg.token_ids[: msg.num_prompt_tokens],
            SamplingParams.from_spec(msg.sampling), self.model.config.eos_token_ids,
            self.max_model_len,
            output_token_ids=msg.token_ids[msg.num_prompt_tokens :],
        )  # fmt: skip
        self.routing[msg.req_id] = RequestRoute(
            msg.reply_to, shards=tuple(msg.shards), num_prompt_tokens=msg.num_prompt_tokens
        )
        self.telemetry.on_handoff(msg.req_id, msg.traceparent)
        self.admission.add(msg)
        self._admit_handoffs()
        return []

    def on_kv(self, pages: KvPages, k: torch.Tensor, v: torch.Tensor) -> None:
        """Local KV for a request this engine will decode (no shard group)."""
        if pages.req_id in self.aborted:
            return  # an abort raced the transfer: keep nothing
        self.kv_events.append(
            KvEvent("received", pages.req_id, pages.layer_start, time.monotonic())
        )
        if not self.blocks.has(pages.req_id):
            self.blocks.allocate(pages.req_id, pages.num_tokens)
        table = torch.tensor(self.blocks.block_table(pages.req_id), dtype=torch.long)
        positions = torch.arange(pages.num_tokens)
        bs = self.blocks.block_size
        slots = table[positions // bs] * bs + positions % bs
        for i in range(pages.num_layers):
            self.runner.kv_cache.write(pages.layer_start + i, k[i], v[i], slots)
        self.admission.kv_landed(pages.req_id, pages.num_layers)
        self._admit_handoffs()

    def on_abort(self, req_id: str) -> Outgoing:
        """Forget a request wherever it is. The token engine decoding it frees its shards: only
        it knows when no decode step of the request can reach a shard any more."""
        self.aborted[req_id] = None
        self.telemetry.aborted(req_id)
        while len(self.aborted) > _TOMBSTONES:
            self.aborted.popitem(last=False)
        route = self.routing.get(req_id)
        frees: Outgoing = []
        if self.admission.is_decoding_here(req_id) and route is not None:
            frees = [(s.kv_endpoint, FreeRequest(req_id)) for s in route.shards]
        self.ship_queue.remove(req_id)
        self.local.remove(req_id)
        self.admission.remove(req_id)
        self.blocks.free(req_id)
        self.requests.pop(req_id, None)
        self.routing.pop(req_id, None)
        return frees

    def fail_all(self, error: str) -> Outgoing:
        """A step failed (a shard died, say): end every request here with the error, free all."""
        return [m for req_id in list(self.routing) for m in self._end(req_id, error)]

    def _end(self, req_id: str, error: str, retryable: bool = False) -> Outgoing:
        """End one request with an error to its client, and forget it here (frees included)."""
        route = self.routing[req_id]
        self.telemetry.aborted(req_id, RuntimeError(error))
        message = TokenOutput(req_id, [], "error", route.num_prompt_tokens, error=error,
                              retryable=retryable)  # fmt: skip
        return [(route.reply_to, message), *self.on_abort(req_id)]

    def relink(self, links: Seq[ShardLink], shards: Seq[ShardAddress], reason: str) -> Outgoing:
        """Decode against `shards` from now on (empty: local attention only).

        Every request tied to the old group (decoding against it, or waiting to) ends with a
        retryable error: the router re-runs it from its tokens on a whole group. Its KV is freed
        on every shard of the old group: this engine cannot tell which one died (a free sent to
        a dead shard is dropped with its socket), and the live ones may hold it without ever
        having decoded it (a handoff still waiting), so no other free would come.
        """
        tied = [s.req_id for s in self.admission.sharded]
        tied += [h.req_id for h in self.admission.waiting if h.shards]
        error = f"engine {self.engine_id}: {reason}"
        out = [m for req_id in tied for m in self._end(req_id, error, retryable=True)]
        self.shards = tuple(shards)
        self.runner.shard_links = list(links)
        self.runner.head_ranges = [(s.head_start, s.head_end) for s in shards]
        log.warning("shard group relinked", engine=self.engine_id, reason=reason,
                    num_failed=len(tied), shards=[s.service_id for s in shards])  # fmt: skip
        return out

    # -- the loop ---------------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(
            self.ship_queue.num_unfinished or self.local.num_unfinished or self.admission.sharded
        )

    @torch.inference_mode()
    def step(self) -> Outgoing:
        """One prefill batch (prompts first, as Splitwise's mixed machines do) or decode step."""
        batch = self.ship_queue.schedule()
        if batch is not None:
            return self._prefill_and_ship(batch)
        batch = self.local.schedule()
        if batch is not None and batch.phase is Phase.PREFILL:
            return self._run_local(batch)
        local = batch.seqs if batch else []
        if not local and not self.admission.sharded:
            return []
        return self._decode(batch, local)

    def _prefill_and_ship(self, batch: Batch) -> Outgoing:
        routes = []
        for seq in batch.seqs:
            r = self.routing[seq.req_id]
            dests = list(r.shards) or [ShardAddress(r.token_kv_endpoint, 0, self._num_kv_heads)]
            layer_wise = seq.num_tokens >= self.role.layer_wise_min_tokens
            routes.append(KvRoute(seq.req_id, dests, layer_wise))
        shipper = KvShipper(routes, len(self.runner.model.layers), self.kv_send)
        self.runner.kv_shipper = shipper
        start_ns = self.telemetry.prefill_started(s.req_id for s in batch.seqs)
        try:
            sampled = self._forward(batch, self.runner.prepare(batch, self._token_ids(batch)))
        finally:
            self.runner.kv_shipper = None
        end_ns = time.time_ns()
        shipper.finish()
        self.telemetry.prefill_done(batch.seqs, start_ns, end_ns)
        self.telemetry.kv_shipped(routes, shipper.num_layers, end_ns)
        for seq in batch.seqs:
            last = len(self.runner.model.layers) - 1
            self.kv_events.append(
                KvEvent("prefilled", seq.req_id, last, shipper.last_layer_done_at)
            )
        out: Outgoing = []
        for seq, token in zip(batch.seqs, sampled, strict=True):
            route = self.routing[seq.req_id]
            out += self._emit(seq.req_id, token)
            if seq.req_id in self.requests:
                out += self._hand_off(seq.req_id)
            else:  # finished at its first token: free the KV it just shipped
                endpoints = [s.kv_endpoint for s in route.shards] or [route.token_kv_endpoint]
                out += [(e, FreeRequest(seq.req_id)) for e in endpoints]
            self.ship_queue.remove(seq.req_id)
        return out

    def _run_local(self, batch: Batch) -> Outgoing:
        start_ns = self.telemetry.prefill_started(s.req_id for s in batch.seqs)
        sampled = self._forward(batch, self.runner.prepare(batch, self._token_ids(batch)))
        self.telemetry.prefill_done(batch.seqs, start_ns, time.time_ns())
        out = self._finish_step(batch, sampled)
        for seq in batch.seqs:  # new prompts decode here next (mixed role)
            self.telemetry.decode_started(seq.req_id)
        return out

    def _decode(self, batch: Batch | None, local: list[Sequence]) -> Outgoing:
        sharded = list(self.admission.sharded)
        token_ids = {s.req_id: self.requests[s.req_id].all_token_ids for s in local + sharded}
        self.admission.grow_sharded()
        inputs = self.runner.prepare_decode(local, sharded, token_ids, next(self.steps))
        everyone = Batch(Phase.DECODE, local + sharded)
        self.telemetry.decode_step(len(everyone.seqs))
        self.runner.round_trips = [] if self.telemetry.samples_round_trips() else None
        sampled = self._forward(everyone, inputs)
        self.telemetry.record_round_trips(self.runner.round_trips or ())
        out = self._finish_step(batch or Batch(Phase.DECODE, []), sampled[: len(local)])
        for seq, token in zip(sharded, sampled[len(local) :], strict=True):
            seq.num_computed, seq.num_tokens = seq.num_tokens, seq.num_tokens + 1
            out += self._emit(seq.req_id, token)
        return out

    def _forward(self, batch: Batch, inputs: object) -> list[int | Exception]:
        """The batch's next tokens; a row whose sampling failed carries the exception instead."""
        logits = self.runner.run(inputs)  # type: ignore[arg-type]
        reqs = [self.requests[s.req_id] for s in batch.seqs]
        sampled, failures = self.sampler.sample(
            logits, [r.params for r in reqs], [len(r.output_token_ids) for r in reqs]
        )
        return [failures.get(row, token) for row, token in enumerate(sampled)]

    def _finish_step(self, batch: Batch, sampled: list[int | Exception]) -> Outgoing:
        out: Outgoing = []
        for seq, token in zip(batch.seqs, sampled, strict=True):
            out += self._emit(seq.req_id, token)
        finished = {s.req_id for s in batch.seqs if s.req_id not in self.requests}
        self.local.update(batch, finished)
        return out

    # -- per-request bookkeeping ------------------------------------------------------------------

    def _emit(self, req_id: str, token: int | Exception) -> Outgoing:
        """Record a token, stream it, and release everything if the request is done. A request
        whose token failed (sampling, finish rules) ends alone, with its error."""
        req, route = self.requests[req_id], self.routing[req_id]
        try:
            if isinstance(token, Exception):
                raise token
            result = req.append(token, tokenizer=None)
        except Exception as exc:  # noqa: BLE001 - this request's fault: its batch-mates go on
            log.warning("request failed", req_id=req_id, error=repr(exc))
            return self._end(req_id, f"request failed: {exc!r}")
        reason = result.finish_reason.value if result.finish_reason else ""
        self.telemetry.token(req_id)
        out: Outgoing = [
            (
                route.reply_to,
                TokenOutput(
                    req_id,
                    [token],
                    reason,
                    route.num_prompt_tokens,
                    index=len(req.output_token_ids) - 1,
                ),  # fmt: skip
            )
        ]
        if reason:
            self.telemetry.finished(req_id, reason)
            out += self._release(req_id)
        return out

    def _release(self, req_id: str) -> Outgoing:
        route = self.routing.pop(req_id)
        self.requests.pop(req_id)
        self.admission.remove(req_id)
        return [(shard.kv_endpoint, FreeRequest(req_id)) for shard in route.shards]

    def _hand_off(self, req_id: str) -> Outgoing:
        req, route = self.requests.pop(req_id), self.routing.pop(req_id)
        handoff = DecodeHandoff(
            req_id=req_id,
            token_ids=req.all_token_ids,
            num_prompt_tokens=len(req.prompt_token_ids),
            sampling=req.params.to_spec(),
            reply_to=route.reply_to,
            num_kv_layers=len(self.runner.model.layers),
            shards=list(route.shards),
            traceparent=self.telemetry.handed_off(req_id),
        )
        return [(route.token_engine, handoff)]

    def _admit_handoffs(self) -> None:
        for req_id in self.admission.admit(self.local):
            self.telemetry.decode_started(req_id)

    def _token_ids(self, batch: Batch) -> dict[str, list[int]]:
        return {s.req_id: self.requests[s.req_id].all_token_ids for s in batch.seqs}

    @property
    def _num_kv_heads(self) -> int:
        return self.model.config.num_key_value_heads

    # -- reporting --------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        used = self.blocks.num_used_blocks + self.admission.shard_blocks.num_used_blocks
        return EngineStats(
            self.engine_id, self.role.name, used, self.blocks.num_blocks, len(self.requests),
            list(self.kv_events),
        )  # fmt: skip

    def load_report(self, now: float) -> LoadReport:
        return LoadReport(
            engine_id=self.engine_id,
            role=self.role.name,
            pending_prompt_tokens=self.ship_queue.pending_prompt_tokens()
            + self.local.pending_prompt_tokens(),
            running_decode_tokens=sum(
                s.num_tokens for s in self.local.running + self.admission.sharded
            ),
            num_running=len(self.local.running) + len(self.admission.sharded),
            num_waiting=self.ship_queue.num_unfinished + len(self.admission.waiting),
            free_kv_blocks=self.blocks.num_free_blocks,
            time=now,
            shard_endpoints=kv_endpoints(self.shards),
        )
