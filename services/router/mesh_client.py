"""The router's client for the disaggregated mesh: prompt and token engines over ZeroMQ.

`MeshEngineClient` implements `EngineClient`. Per request it admits (`StreamTable`: bounds ->
`Overloaded`, a 429; no ready engine -> `Unavailable`, a 503), places (JSQ: prompt and token
engine together, `cluster_scheduler`), sends one `GenerateRequest` to the prompt engine with
`reply_to` = this router's inbox (`mesh_inbox`), and turns the `TokenOutput`s that come back into
`RequestOutput`s (`token_text`: the engines' finish reasons, the router's text and stop strings).
A stop-string hit, or a client that goes away, aborts the request at its prompt and token engine
(the token engine frees the shards).

A request whose engines are lost is re-run elsewhere from its tokens (`migration`): its token
engine or a shard of its group answers with a retryable error, or the watch thread, reading the
registry every `refresh_s` (`mesh_membership`), finds its token engine (or its prompt engine,
before the hand-off) gone. The requests, their ledgers and their current attempts' engines are
kept together in `mesh_requests`. docs/failures.md has the whole model.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncGenerator, Callable
from pathlib import Path

import structlog
import zmq
from opentelemetry import trace

from common.engine.request import OutputText, RequestOutput
from common.mesh_options import MAX_MIGRATIONS, PREFIX_ROUTING_WEIGHT
from common.protocol import (
    AbortRequest,
    EngineCommand,
    GenerateRequest,
    LoadReport,
    TokenOutput,
)
from common.sampling_params import SamplingParams
from common.scheduling.cluster import PoolThresholds
from common.telemetry import Metrics, bind_request, inject_context, set_route
from common.tokenizer import Tokenizer
from common.transport.service_stats import request_stats
from common.transport.zmq_auth import CurveKeys
from common.transport.zmq_sockets import PushPool
from services.mesh.absence import Absences
from services.mesh.registry import ServiceEntry
from services.mesh.registry_watch import WaitChange
from services.router.cluster_scheduler import (
    ClusterScheduler,
    NoEngines,
    NoKvRoom,
    kv_grow_tokens,
)
from services.router.coalesce import coalesce
from services.router.engine_client import EngineClientStats
from services.router.kv_queue import KvWaitQueue
from services.router.mesh_inbox import MeshInbox
from services.router.mesh_membership import REFRESH_S, MeshMembership
from services.router.mesh_requests import EngineLost, MeshRequests, MeshStream
from services.router.metrics_endpoint import LatestReports
from services.router.migration import Replay
from services.router.streams import AdmissionLimits, Unavailable, next_items
from services.router.token_text import StreamedText, join_token_outputs

log = structlog.get_logger(__name__)

# The first re-run waits this long, each next one twice as long (at most MIGRATION_BACKOFF_MAX_S):
# one fault often ends an attempt several times while the mesh settles (a shard dies: its group
# is dropped, then relinked to its replacement), and a re-run placed on the view of a moment ago
# would use up the request's migrations on the same fault.
MIGRATION_BACKOFF_S = 0.25
MIGRATION_BACKOFF_MAX_S = 2.0
# A migrated request waits this long at most for a prompt and a token engine (a replica Serve is
# restarting loads its model first), retrying every PLACE_RETRY_S.
MIGRATION_WAIT_S = 60.0
PLACE_RETRY_S = 0.25
PROGRESS_TIMEOUT_S = 30.0  # `MeshOptions.progress_timeout_s`


class MeshEngineClient:
    """`EngineClient` over the mesh; `list_services` returns the registry's live entries."""

    def __init__(
        self,
        model_path: str | Path,
        list_services: Callable[[], list[ServiceEntry]],
        *,
        auth: CurveKeys,
        host: str = "127.0.0.1",
        block_size: int = 16,
        limits: AdmissionLimits | None = None,
        refresh_s: float = REFRESH_S,
        max_migrations: int = MAX_MIGRATIONS,
        metrics: Metrics | None = None,
        prefix_routing_weight: float = PREFIX_ROUTING_WEIGHT,
        pool_thresholds: PoolThresholds | None = None,
        progress_timeout_s: float = PROGRESS_TIMEOUT_S,
        wait_change: WaitChange | None = None,
    ) -> None:
        """`list_services`: the registry's live entries; `wait_change`: its long poll, which
        the membership thread then waits on instead of reading every `refresh_s`."""
        self.tokenizer = Tokenizer(model_path)
        self.max_context: int | None = None  # each engine bounds its own (KV refusals)
        self.auth = auth  # the mesh's CURVE keys: every socket to and from it uses them
        # KV-aware: the engines name their cached blocks with a chain seeded by the model folder's
        # name (`services/engine/engine.py`); the router hashes prompts the same way.
        self.scheduler = ClusterScheduler(
            block_size, pool_thresholds, prefix_weight=prefix_routing_weight,
            cache_namespace=Path(model_path).name,
        )  # fmt: skip
        self.metrics = metrics
        self.reports = LatestReports()  # each engine's latest, for /metrics
        self.requests = MeshRequests(limits, max_migrations)
        self.streams, self.book = self.requests.streams, self.requests.book
        # Requests no token engine has KV room for yet, waiting in order (kv_queue.py).
        self.kv_queue = KvWaitQueue(lambda: self.streams.limits)
        self.num_migrations = 0  # re-runs of requests whose engines or shards failed (stats)
        self.progress_timeout_s = progress_timeout_s
        # Under the streams' lock: the ledgers, the counts and the membership.
        self._lock = self.requests.lock
        self.ctx = zmq.Context()
        self.inbox = MeshInbox(
            self.ctx, host, self.requests.deliver_outputs, self._on_load, auth=auth
        )
        self.reply_endpoint = self.inbox.reply_endpoint
        # The engines count this router's requests by it (`LoadReport.received_requests`).
        self.scheduler.reply_endpoint = self.reply_endpoint
        self._orderer = self.inbox.orderer
        self._push: PushPool[EngineCommand] = PushPool(self.ctx, EngineCommand, auth=auth)
        self._push_lock = threading.Lock()
        self._push_absences = Absences()  # engines' command endpoints the registry lacks
        self.membership = MeshMembership(
            list_services, self.requests, self.scheduler, self.inbox, self._send_role_changes,
            refresh_s=refresh_s, metrics=metrics, prune_links=self._prune_links,
            wait_change=wait_change,
        )  # fmt: skip
        self.membership.refresh()
        self._threads = [self.inbox.thread, self.membership.thread]
        for thread in self._threads:
            thread.start()

    # ---- asyncio side ----

    async def generate(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        hold_to_end: bool = False,
    ) -> AsyncGenerator[RequestOutput, None]:
        self.inbox.attach()  # its replies are drained on this loop
        kv_tokens = len(prompt_token_ids) + params.max_tokens  # its whole length
        stream = await self.kv_queue.admit(
            lambda: self._admit(req_id, prompt_token_ids, params, hold_to_end),
            lambda: self.scheduler.check_ever_fits(kv_tokens),
            params.priority,
        )
        text = StreamedText(req_id, len(prompt_token_ids), OutputText.of(params), self.tokenizer)
        # From its send (`admit` returns once it left): its wait for room was the router's.
        self._watch(req_id, stream)
        engine_done = finished = False
        try:
            while not finished:
                # Whatever arrived together leaves as one output (one SSE chunk); anything but
                # tokens (a loss, an error) first sends on the tokens before it.
                pending: list[RequestOutput] = []
                for item in join_token_outputs(await next_items(stream.outputs)):
                    if pending and (isinstance(item, Exception) or item.error):
                        yield coalesce(pending)
                        pending = []
                    if isinstance(item, EngineLost) or (
                        isinstance(item, TokenOutput) and item.error and item.retryable
                    ):
                        # One loss can be told twice (the engine's error, then its registry
                        # entry leaving): only a loss of the current attempt migrates.
                        lost_id = item.wire_id if isinstance(item, EngineLost) else item.req_id
                        if lost_id == self._wire_id(req_id):
                            reason = item.error if isinstance(item, TokenOutput) else str(item)
                            await self._migrate(req_id, stream, text.output_token_ids, reason)
                        continue
                    if isinstance(item, Exception):
                        raise item
                    engine_done = bool(item.finish_reason)
                    pending += text.on_tokens(item)
                    if pending and pending[-1].finished:
                        break  # later tokens (after a stop string) are dropped
                if pending:
                    finished = pending[-1].finished
                    yield coalesce(pending)
        finally:
            self._unwatch(stream)
            if not engine_done:
                with bind_request(req_id, traceparent=stream.traceparent):
                    log.info("aborting request in the mesh", finished=finished)
                self._send_aborts(stream, self._wire_id(req_id))
            self._release(req_id)

    def _watch(self, req_id: str, stream: MeshStream) -> None:
        """(Re)start the request's progress deadline, on its loop: its attempt was just sent to
        its engines, which have `progress_timeout_s` from now to show output."""
        self._unwatch(stream)
        stream.watch = stream.loop.call_later(self.progress_timeout_s, self._watch_progress,
                                              req_id, stream, stream.num_delivered)  # fmt: skip

    def _unwatch(self, stream: MeshStream) -> None:
        """Stop the progress deadline: the request ended, or waits in the router for a re-run
        (backoff, room, engines: the router's own time, bounded by `MIGRATION_WAIT_S`)."""
        if stream.watch is not None:
            stream.watch.cancel()
            stream.watch = None

    def _watch_progress(self, req_id: str, stream: MeshStream, seen: int) -> None:
        """Every `progress_timeout_s` on the request's loop while its attempt is with its
        engines: no output since the last look (held ones count) means its attempt is lost. An
        engine that could not send its outputs (the router stopped reading) gave the request
        up; nothing else would ever say so."""
        if self.streams.get(req_id) is not stream:
            return  # released: the watch ends
        if stream.num_delivered == seen and not stream.lost:
            wire_id = self._wire_id(req_id)
            why = f"no output from its engines for {self.progress_timeout_s} s"
            with self._lock:
                stream.lost = True  # one loss told once; the re-run clears it
            stream.outputs.put_nowait(EngineLost(why, wire_id))
        self._watch(req_id, stream)

    def abort(self, req_id: str) -> None:
        """Stop a request at its prompt and token engine; outputs in flight are dropped."""
        wire_id = self._wire_id(req_id)
        stream = self._release(req_id)
        if stream is not None:
            self._send_aborts(stream, wire_id)

    def stats(self) -> EngineClientStats:
        """Router counters plus what every live service holds (KV blocks used anywhere)."""
        with self._lock:
            services = list(self.membership.services)
            num_requests, pending = len(self.streams), self.streams.num_pending_prompt_tokens
            by_engine = dict(self.requests.by_engine)
        endpoints = [s.control_endpoint for s in services if s.control_endpoint]
        replies = list(request_stats(endpoints, 2.0, auth=self.auth).values())
        return EngineClientStats(
            num_requests=num_requests,
            num_pending_prompt_tokens=pending,
            num_engine_requests=sum(r.num_requests for r in replies),
            kv_blocks_used=sum(r.kv_blocks_used for r in replies),
            kv_blocks_total=sum(r.kv_blocks_total for r in replies),
            requests_by_engine=by_engine,
            services={
                r.service_id: {
                    "role": r.role,
                    "home_role": r.home_role or r.role,
                    "num_loans": r.num_loans,
                    "num_home_moves": r.num_home_moves,  # its home changed (home_roles.py)
                    # A token engine's model peers (Lamina 4.3): slices they ran, peers lost
                    # and peer links made, since it started.
                    "num_peer_slices": r.num_peer_slices,
                    "num_peers_lost": r.num_peers_lost,
                    "num_peers_joined": r.num_peers_joined,
                    "num_group_relinks": r.num_group_relinks,  # its shard group's changes
                    # Requests kept through a dead shard (its heads rebuilt), or migrated instead.
                    "num_rebuilt": r.num_rebuilt,
                    "num_rebuild_fallbacks": r.num_rebuild_fallbacks,
                    # Requests it preempted for KV and recomputed (memory-aware batching).
                    "num_preemptions": r.num_preemptions,
                    "num_prefill_chunks": r.num_prefill_chunks,  # long prefills' chunk steps
                    "kv_blocks_used": r.kv_blocks_used,
                    "num_requests": r.num_requests,
                }
                for r in replies
            },  # fmt: skip
        )

    def engine_reports(self) -> list[LoadReport]:
        return self.reports.live()

    def ready(self) -> bool:
        """The router's threads run and there is a ready prompt and token engine."""
        return self.alive() and self.scheduler.can_place()

    def alive(self) -> bool:
        """The router's own threads run and its replies are drained (engines may still be
        starting)."""
        return all(t.is_alive() for t in self._threads) and self.inbox.healthy()

    def shutdown(self) -> None:
        self.membership.close()
        self.inbox.close()
        for thread in self._threads:
            thread.join(timeout=5)
        with self._push_lock:
            self._push.close()
        self.ctx.destroy(linger=0)

    def _admit(
        self, req_id: str, prompt_ids: list[int], params: SamplingParams, hold_to_end: bool
    ) -> MeshStream:
        num_tokens = len(prompt_ids)
        kv_tokens = num_tokens + params.max_tokens  # its whole length: what its KV may hold
        kv_grow = kv_grow_tokens(num_tokens, params.max_tokens)  # what a shard group needs now

        def place() -> MeshStream:  # under the table's lock, once admission allows it
            try:
                prompt, token = self.scheduler.choose(num_tokens, prompt_ids, kv_tokens, req_id,
                                                      kv_grow)  # fmt: skip
            except NoEngines as exc:
                raise Unavailable("no_engines", "No engine is ready. Please retry later.") from exc
            self.requests.open(req_id, prompt_ids, params.to_spec(), (prompt, token))
            # The caller's current span is the request's (`RequestTrace.admission`).
            return MeshStream(
                req_id=req_id, num_prompt_tokens=num_tokens, hold_to_end=hold_to_end,
                prompt_engine=prompt, token_engine=token, traceparent=inject_context(),
                span=trace.get_current_span(),
            )  # fmt: skip

        stream = self.streams.admit(req_id, num_tokens, place)
        prompt, token = stream.prompt_engine, stream.token_engine
        set_route(trace.get_current_span(), prompt_engine=prompt.service_id,
                  token_engine=token.service_id, shards=self._shard_ids(token))  # fmt: skip
        msg = GenerateRequest(
            req_id=req_id, prompt_token_ids=list(prompt_ids), sampling=params.to_spec(),
            reply_to=self.reply_endpoint, token_engine=token.command_endpoint,
            token_kv_endpoint=token.kv_endpoint, token_kv_address=token.kv_address,
            shards=list(token.shards), traceparent=stream.traceparent,
        )  # fmt: skip
        self._orderer.expect(req_id, 0)  # before it leaves: no token of it can arrive earlier
        try:
            self._send(prompt.command_endpoint, msg)
        except zmq.Again as exc:  # its queue is full: it died or stopped reading
            self._release(req_id)
            raise Unavailable("engine_unreachable", f"prompt engine {prompt.service_id} is not "
                              "taking requests") from exc  # fmt: skip
        except BaseException:
            self._release(req_id)  # admitted but never sent: its slot must not leak
            raise
        return stream

    async def _migrate(
        self, req_id: str, stream: MeshStream, output_token_ids: list[int], reason: str
    ) -> None:
        """Re-run a request whose engines or shards were lost, from the tokens it has so far.
        Until it is sent, it waits in the router (backoff, then room or engines) unwatched by
        the progress deadline, and ahead of every new request for room (`kv_queue`)."""
        self._unwatch(stream)
        old_wire_id, replay = self.requests.next_attempt(req_id, output_token_ids)
        self._send_aborts(stream, old_wire_id)
        self._orderer.forget(old_wire_id)
        if replay is None:
            raise RuntimeError(
                f"generation failed: {reason} (after {self.book.max_migrations} migrations)"
            )
        with bind_request(req_id, traceparent=stream.traceparent):
            log.warning("migrating request", reason=reason, attempt=replay.wire_id,
                        num_output_tokens=len(replay.output_token_ids))  # fmt: skip
        self.num_migrations += 1
        if self.metrics is not None:
            self.metrics.count_migration("engine_lost")
        if stream.span is not None:
            stream.span.add_event("migration", {"phasemesh.reason": reason,
                                                "phasemesh.attempt": replay.wire_id})  # fmt: skip
        with self.kv_queue.rerun_first():
            prompt, token = await self._rerun_engines(req_id, replay, reason)
        with self._lock:
            stream.prompt_engine, stream.token_engine = prompt, token
            stream.num_attempt_tokens, stream.lost = 0, False
        # NOTE: set before the request leaves: no message of this attempt can arrive earlier.
        self._orderer.expect(replay.wire_id, len(replay.output_token_ids))
        msg = GenerateRequest(
            req_id=replay.wire_id, prompt_token_ids=replay.prompt_token_ids,
            sampling=replay.sampling, reply_to=self.reply_endpoint,
            token_engine=token.command_endpoint, token_kv_endpoint=token.kv_endpoint,
            token_kv_address=token.kv_address, shards=list(token.shards),
            traceparent=stream.traceparent,
            output_token_ids=replay.output_token_ids,
        )  # fmt: skip
        self._send_role_changes()  # an engine lent for this request hears it first
        self._send(prompt.command_endpoint, msg)
        self._watch(req_id, stream)

    async def _rerun_engines(
        self, req_id: str, replay: Replay, reason: str
    ) -> tuple[ServiceEntry, ServiceEntry]:
        """The engines of a re-run, after its backoff: the mesh settles after a fault."""
        attempt = self.book.ledgers[req_id].attempt
        await asyncio.sleep(min(MIGRATION_BACKOFF_S * 2 ** (attempt - 1), MIGRATION_BACKOFF_MAX_S))
        num_tokens = len(replay.prompt_token_ids) + len(replay.output_token_ids)
        kv_tokens = len(replay.prompt_token_ids) + replay.sampling.max_tokens
        kv_grow = kv_grow_tokens(num_tokens, kv_tokens - num_tokens)
        return await self._place_when_ready(req_id, num_tokens, (kv_tokens, kv_grow), reason)

    async def _place_when_ready(
        self, req_id: str, num_tokens: int, kv: tuple[int, int], reason: str
    ) -> tuple[ServiceEntry, ServiceEntry]:
        """A prompt and a token engine with KV room, waiting (bounded) while replacements start
        or room frees."""
        deadline = time.monotonic() + MIGRATION_WAIT_S
        while True:
            try:
                with self._lock:
                    self.scheduler.released(req_id)  # the lost attempt's hold, if it has one
                    placed = self.scheduler.choose(num_tokens, kv_tokens=kv[0], req_id=req_id,
                                                   kv_grow=kv[1])  # fmt: skip
                self._send_role_changes()
                return placed
            except (NoEngines, NoKvRoom):
                if time.monotonic() > deadline:  # a 503 where nothing was sent yet
                    raise Unavailable(
                        "no_engines",
                        f"generation failed: {reason}; no engine with room in "
                        f"{MIGRATION_WAIT_S} s. Please retry later.",
                    ) from None
            # NOTE: membership changes arrive by the watch thread's registry reads; a short
            # asyncio sleep keeps this request's coroutine off the event loop meanwhile.
            await asyncio.sleep(PLACE_RETRY_S)

    def _wire_id(self, req_id: str) -> str:
        return self.requests.wire_id(req_id)

    def _shard_ids(self, token: ServiceEntry) -> list[str]:
        """The service ids of a token engine's shard group."""
        return [s.service_id or s.kv_endpoint for s in token.shards]

    def _send_aborts(self, stream: MeshStream, wire_id: str) -> None:
        """Abort an attempt at its engines that are still members (a dead one's socket would
        only queue the message)."""
        live = self.membership.live_ids()
        for engine in (stream.prompt_engine, stream.token_engine):
            if engine is not None and engine.service_id in live:
                try:
                    self._send(engine.command_endpoint, AbortRequest(wire_id))
                except zmq.Again:  # not reading: it frees on its own when it goes
                    log.warning("abort not delivered", engine=engine.service_id, req_id=wire_id)

    def _on_load(self, report: LoadReport) -> None:
        """A load report (the inbox's SUB thread): the placement view and `/metrics`."""
        self.scheduler.on_load(report)
        self.reports.on_report(report)

    def _send_role_changes(self) -> None:
        """The pool changes the scheduler asked for: lend, renew, return (`pool_state.py`)."""
        for engine, change in self.scheduler.take_role_changes():
            self._send(engine.command_endpoint, change)

    def _send(self, endpoint: str, msg: EngineCommand) -> None:
        with self._push_lock:
            self._push.get(endpoint).send(msg)

    def _prune_links(self, live: set[str], now: float) -> None:
        """Close the command socket of each engine missing from the registry for
        `ABSENT_CONFIRM_S` (longer than a restarted registry actor forgets a live one): ZeroMQ
        would reconnect to it forever and hold what was queued for it. An engine that comes
        back at that endpoint gets a fresh socket with the next message for it."""
        with self._push_lock:
            gone = self._push_absences.gone(self._push.endpoints(), live, now)
            for endpoint in gone:
                self._push.drop(endpoint)
        if gone:
            log.info("closed links to engines gone from the registry", endpoints=sorted(gone))

    def _release(self, req_id: str) -> MeshStream | None:
        self.scheduler.released(req_id)
        stream, wire_id = self.requests.release(req_id)
        self._orderer.forget(wire_id)
        return stream
