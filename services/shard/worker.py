"""Run an `AttentionShard` as a process: UCX for KV pages and per-layer attention, ZeroMQ for
control.

Three threads, each owning its sockets: the KV receiver (`common/transport/kv_links.py`) lands KV
pages from prompt engines' UCX links; the ingress thread drains frees, shutdown and stats requests
from ZeroMQ (and KV pages too where `kv_over_ucx` is off); the main thread answers the token
engine's per-layer round trips on its UCX channel. Where prompt engines hold KV for pulling
(`kv_transfer: pull`), a fourth, the puller (`kv_puller.py`), fetches announced KV and lands it
between decode steps (`step_gate.py`); every landing, pushed or pulled, is news for the token
engine (`kv_news.py`), told in the next reply. Each blocks on its event fd or poller (no
busy-polling: shards share their cores with the engines they serve). The two ingress threads take
turns (`_ingress_lock`): `KvIngress` serves one ingress thread.
"""

from __future__ import annotations

import threading
import time

import structlog
import torch
import zmq

from common.attention import select_backend
from common.config import ModelConfig
from common.kv_ingress import Landed
from common.protocol import (
    ATTEND_NEW,
    ATTEND_PREV,
    ATTEND_WHOLE,
    AttendBatch,
    AttendResult,
    FetchKv,
    FreeRequest,
    KvAnnounce,
    KvControl,
    KvPages,
    KvReadyQuery,
    KvSwapAck,
    ServiceReply,
    ShardIngress,
    ShardLinkMessage,
    Shutdown,
    StatsRequest,
)
from common.roles import Role
from common.telemetry import Metrics
from common.transport.kv_links import KvReceiver, KvSender
from common.transport.ucx_channel import ChannelClosed, UcxTensorChannel, refuse
from common.transport.ucx_listener import UcxListener
from common.transport.zmq_sockets import TypedSocket, bind_random
from common.worker_config import WorkerConfig, WorkerReady
from services.shard.kv_news import KvNews
from services.shard.kv_puller import KvPuller
from services.shard.shard import AttentionShard, ShardSpec
from services.shard.step_gate import StepGate
from services.shard.telemetry import ShardTelemetry

log = structlog.get_logger(__name__)

POLL_S = 0.2  # a link this long without a message is idle: its step is over
# An idle shard's threads wake this often to notice shutdown (`running`); messages, hellos and
# control wake them at once. Within `MeshReplica.stop`'s wait for the worker.
IDLE_WAIT_S = 1.0
NEWS_WAIT_MAX_S = 0.1  # the longest a `KvReadyQuery` may keep the main thread waiting for news
GAUGE_INTERVAL_S = 0.5  # KV blocks in use, set at most this often
NUM_BUFFERS = {ATTEND_WHOLE: 3, ATTEND_PREV: 1, ATTEND_NEW: 2}  # per `AttendBatch.part`


class ShardWorker:
    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg, opts = cfg, cfg.options
        mc = ModelConfig.from_folder(cfg.model_path)
        spec = ShardSpec.of_model(
            mc, cfg.head_start, cfg.head_end, opts.shard_num_blocks, opts.block_size
        )
        self.shard = AttentionShard(cfg.service_id, spec, select_backend(opts.attention_backend))
        self.ctx = zmq.Context()
        auth = cfg.curve_keys  # only the mesh's members get through (zmq_auth.py)
        kv, self.kv_endpoint = bind_random(self.ctx, zmq.PULL, cfg.host, auth=auth)
        ctl, self.control_endpoint = bind_random(self.ctx, zmq.ROUTER, cfg.host, auth=auth)
        # KV pages over UCX: the ZeroMQ socket then takes only control (a KvPages there is dropped).
        self.kv_in: TypedSocket[ShardIngress] = TypedSocket(
            kv, KvControl if opts.kv_over_ucx else ShardIngress
        )
        self.control: TypedSocket[StatsRequest] = TypedSocket(ctl, StatsRequest)
        self.replies: TypedSocket[ServiceReply] = TypedSocket(ctl, ServiceReply)
        key = bytes.fromhex(cfg.mesh_key)
        self.listener = UcxListener(ShardLinkMessage, cfg.host, key)
        self._ingress_lock = threading.Lock()
        self.kv_receiver = KvReceiver(cfg.host, key, self._on_ingress) if opts.kv_over_ucx else None
        self.swap_sender: KvSender | None = None  # KV swapped back to token engines (Neo)
        self.news = KvNews()
        self.gate = StepGate()
        self.puller = KvPuller(
            self.gate, self._on_ingress, self._pull_lost, auth, shard_id=cfg.service_id
        )
        self.metrics = Metrics(model_name=cfg.model_name, engine=cfg.service_id)
        self.telemetry = ShardTelemetry(cfg.service_id, spec.num_layers)  # shard.attend spans
        self._last_gauge = 0.0
        self.running = True
        self.last_pass = time.monotonic()  # the attention loop's; health is progress
        # Per lane: why an ATTEND_PREV failed, answered (as an error) when its ATTEND_NEW comes.
        self._prev_errors: dict[int, Exception] = {}
        self._prev_s: dict[int, float] = {}  # per lane: the ATTEND_PREV's attention time

    def ready(self) -> WorkerReady:
        return WorkerReady(
            self.cfg.service_id, Role.SHARD, kv_endpoint=self.kv_endpoint,
            control_endpoint=self.control_endpoint, link_address=self.listener.address,
            kv_address=self.kv_receiver.address if self.kv_receiver else "",
        )  # fmt: skip

    def run(self) -> None:
        ingress = threading.Thread(target=self._ingress_loop, name="kv-ingress", daemon=True)
        ingress.start()
        self.serve_links()
        ingress.join(timeout=2)
        self.puller.close()
        if self.kv_receiver is not None:
            self.kv_receiver.close()
        if self.swap_sender is not None:
            self.swap_sender.close()

    def serve_links(self) -> None:
        """The main thread: one token engine's link after another, until shutdown."""
        link = self._accept()
        while link is not None:
            link = self._serve(link) or self._accept()

    def _serve(
        self, link: UcxTensorChannel[ShardLinkMessage]
    ) -> UcxTensorChannel[ShardLinkMessage] | None:
        """Answer one token engine's round trips until shutdown, until that engine is gone, or
        until a newer link (returned) takes over an idle one.

        A token engine that dies leaves its requests' KV here: free it, and wait for the next
        token engine (a restarted replica) to connect. Newest link wins, as on a model peer: an
        engine that gives its links up (`ShardLinkFault`) and links again closes the old one on
        its side only, which this side is not told of while the engine's process lives.
        """
        while self.running:
            self.last_pass = time.monotonic()
            if not self._await_message(link):  # idle, and a newer link said hello (or stopping)
                if (newer := self._newer_link()) is not None:
                    self._link_over("a new token engine link; closing the idle old one")
                    link.close()
                    return newer
                continue
            try:
                header, tensors = link.recv(timeout=POLL_S)  # in already: no wait
            except TimeoutError:
                continue
            except ChannelClosed:
                self._link_over("token engine link closed; its requests freed")
                break
            except Exception as exc:  # noqa: BLE001 - one it cannot take must not stop the shard
                # Malformed (the stream may be misaligned now), or tensors that fit neither the
                # message nor memory. Answered for no step, so that the engine relinks at once
                # instead of waiting out its reply timeout (a closed endpoint tells it nothing);
                # then this link closes and its requests here are freed.
                self._link_over("message on the link not received; closing it", exc, trace=True)
                refuse(link, AttendResult(-1, -1, error=f"message not received: {exc!r}"))
                break
            try:
                self._handle(link, header, tensors)
            except (ChannelClosed, TimeoutError) as exc:  # the engine died after asking
                self._link_over("token engine link lost while replying; its requests freed", exc)
                break
        self.gate.end_step()
        link.close()
        return None

    def _link_over(
        self, event: str, error: BaseException | None = None, trace: bool = False
    ) -> None:
        """A link ends: the requests its engine decoded here are freed (it re-runs them)."""
        freed = self.shard.free_decoded()
        error_repr = None if error is None else repr(error)
        log.warning(event, freed=freed, error=error_repr, exc_info=error if trace else None)

    def _handle(
        self, link: UcxTensorChannel[ShardLinkMessage], header: object, tensors: list[torch.Tensor]
    ) -> None:
        """One message of the link; a reply that cannot be sent raises ChannelClosed or
        TimeoutError (the link is over)."""
        if isinstance(header, AttendBatch) and len(tensors) == NUM_BUFFERS.get(header.part):
            if header.part == ATTEND_PREV:
                self._attend_prev(header, tensors[0])
            else:
                self._answer(link, header, tensors)
        elif isinstance(header, KvReadyQuery):
            landed, lost = self.news.drain(min(header.wait_s, NEWS_WAIT_MAX_S))
            link.send(AttendResult(header.step, -1, kv_landed=landed, kv_lost=lost), [])
        else:
            log.warning("dropped unexpected link message", kind=type(header).__name__)

    def _await_message(self, link: UcxTensorChannel[ShardLinkMessage]) -> bool:
        """Wait for `link`'s next message (or its peer's end): True once it is in. After `POLL_S`
        without one the link is idle (its step is over: `StepGate`), and a hello from a newer
        link ends the wait (False), as does shutdown. Sleeps in epoll throughout, woken by a
        message or a hello and otherwise every `IDLE_WAIT_S`, not by a clock."""
        idle_at = time.monotonic() + POLL_S
        while self.running:
            if link.has_message():
                return True
            left_s = idle_at - time.monotonic()
            if left_s > 0:
                self.listener.idle_until(lambda: link.has_message() or not self.running, left_s)
                continue
            self.gate.end_step()  # an idle link: no step is in progress (step_gate.py)
            if self.listener.has_hello():
                return False
            self.last_pass = time.monotonic()
            self.listener.idle_until(
                lambda: link.has_message() or self.listener.has_hello() or not self.running,
                IDLE_WAIT_S,
            )
        return False

    def _newer_link(self) -> UcxTensorChannel[ShardLinkMessage] | None:
        """A link that has said hello meanwhile, once its hello checks out (a hello without the
        mesh's key is dropped and costs the current link nothing)."""
        if not self.listener.has_hello():
            return None
        try:
            return self.listener.accept(timeout=0)
        except TimeoutError:
            return None

    def _accept(self) -> UcxTensorChannel[ShardLinkMessage] | None:
        while self.running:
            self.last_pass = time.monotonic()
            if not self.listener.idle_until(self._hello_or_shutdown, IDLE_WAIT_S):
                continue
            if not self.running:
                break
            try:
                return self.listener.accept(timeout=0)  # said hello: a bad one is dropped
            except TimeoutError:
                continue
        return None

    def _hello_or_shutdown(self) -> bool:
        """What ends an idle wait for a link: a hello, or shutdown (whose message wakes it)."""
        return self.listener.has_hello() or not self.running

    def _attend_prev(self, batch: AttendBatch, q: torch.Tensor) -> None:
        """The first half of an overlapped layer: no reply of its own. A failure is kept and
        answered as its layer's error when the second half (ATTEND_NEW) comes."""
        self._prev_errors.pop(batch.lane, None)
        if batch.layer == 0:
            self.gate.start_step()
        if batch.lane == 0:  # NOTE: spans follow lane 0 only; one record per step (telemetry.py)
            self.telemetry.layer_started(batch)
        try:
            started = time.perf_counter()
            self.shard.attend_prev(batch, q)
            self._prev_s[batch.lane] = time.perf_counter() - started
        except Exception as exc:  # noqa: BLE001 - answered with ATTEND_NEW, never raised here
            log.exception("attention over previous tokens failed", step=batch.step,
                          layer=batch.layer)  # fmt: skip
            self._prev_errors[batch.lane] = exc

    def _answer(
        self, link: UcxTensorChannel[ShardLinkMessage], batch: AttendBatch, bufs: list[torch.Tensor]
    ) -> None:
        """Answer a whole layer (q, k, v) or an overlapped layer's second half (k, v)."""
        traced = batch.lane == 0
        started = time.perf_counter()
        if batch.layer == 0:
            self.gate.start_step()
        try:
            if batch.part == ATTEND_NEW:
                if (error := self._prev_errors.pop(batch.lane, None)) is not None:
                    raise error
                out, _, failed = self.shard.attend_new(batch, *bufs)
            else:
                if traced:
                    self.telemetry.layer_started(batch)
                out, _, failed = self.shard.attend(batch, *bufs)
            if traced:
                self.telemetry.layer_done(batch, len(failed), self.shard.blocks.num_used_blocks)
            attend_s = time.perf_counter() - started + self._prev_s.pop(batch.lane, 0.0)
            landed, lost = self.news.drain()
            reply = AttendResult(batch.step, batch.layer, failed=failed, lane=batch.lane,
                                 attend_s=attend_s, kv_landed=landed, kv_lost=lost)  # fmt: skip
            link.send(reply, [out])
            if traced:
                self.telemetry.flush()
        except ChannelClosed:
            raise  # no engine left to answer (`_serve` ends the link)
        except Exception as exc:  # noqa: BLE001 - the engine must get an answer, not a hang
            if traced:
                self.telemetry.layer_failed(batch, exc)
            log.exception("attention failed", step=batch.step, layer=batch.layer)
            n, hq, d = bufs[0].shape  # q, or k: then the query heads are `group` per KV head
            hq *= 1 if batch.part == ATTEND_WHOLE else self.shard.spec.num_queries_per_kv
            empty = [torch.zeros(n, hq, d)]
            link.send(AttendResult(batch.step, batch.layer, error=repr(exc), lane=batch.lane),
                      empty)  # fmt: skip
        # NOTE: with decode lanes, the first lane to finish its last layer ends the step.
        if batch.layer == self.shard.spec.num_layers - 1:
            self.gate.end_step()

    def _ingress_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.kv_in.sock, zmq.POLLIN)
        poller.register(self.control.sock, zmq.POLLIN)
        while self.running:
            poller.poll(int(IDLE_WAIT_S * 1000))  # leases (minutes) and gauges need no more
            while (item := self.kv_in.recv_tensors_nowait()) is not None:
                self._on_ingress(*item)
            while (req := self.control.recv_nowait()) is not None:
                self.replies.send(self.shard.stats(), prefix=req[0])
            with self._ingress_lock:
                expired = self.shard.expire_leases()
            if expired:
                log.warning("unclaimed KV freed after its lease", req_ids=expired[:8],
                            num_freed=len(expired))  # fmt: skip
            self._set_gauges()
        self.ctx.destroy(linger=0)

    def _set_gauges(self) -> None:
        now = time.monotonic()
        if now - self._last_gauge >= GAUGE_INTERVAL_S:
            self._last_gauge = now
            used = self.shard.blocks.num_used_blocks  # NOTE: a racy read of an int, for a gauge
            self.metrics.set_kv_blocks_used(used, shard=self.cfg.service_id)

    def _on_ingress(self, header: ShardIngress, tensors: list[torch.Tensor]) -> None:
        with self._ingress_lock:
            self._land(header, tensors)

    def _pull_lost(self, req_id: str, why: str) -> None:
        log.warning("KV pull failed; the request's KV is lost here", req_id=req_id, why=why)
        self.news.lost(req_id)

    def _land(self, header: ShardIngress, tensors: list[torch.Tensor]) -> None:
        try:
            if isinstance(header, KvPages) and len(tensors) == 2:
                landed = self._land_pages(header, tensors)
                if header.ack_to:
                    self._ack_swap_out(header, landed)
            elif isinstance(header, KvAnnounce):
                self.puller.announce(header)
            elif isinstance(header, FetchKv):
                self._fetch(header)
            elif isinstance(header, FreeRequest):
                self.shard.free(header.req_id, header.kv_generation)
            elif isinstance(header, Shutdown):
                self.running = False
                self.listener.wake()  # the main thread's idle wait ends now, not at its timeout
            else:
                log.warning("dropped unexpected ingress message", kind=type(header).__name__)
        except Exception:  # noqa: BLE001 - one bad message must not stop the shard
            log.exception("ingress message failed", kind=type(header).__name__)

    def _ack_swap_out(self, pages: KvPages, landed: Landed) -> None:
        """Tell a token engine swapping a request out whether all its layers landed here."""
        if landed is Landed.PARTIAL:
            return
        error = "" if landed is Landed.COMPLETE else f"its KV was {landed.value} here"
        ack = KvSwapAck(pages.req_id, self.cfg.head_start, self.cfg.head_end, error)
        self._swap_sender().send_message(pages.ack_to, ack, [])

    def _fetch(self, fetch: FetchKv) -> None:
        """A swap-in: this shard's heads of the request's KV back to its token engine, one
        message per layer, on the KV sender's thread; the KV leaves this shard (`FetchKv`)."""
        try:
            k, v = self.shard.read_kv(fetch.req_id, fetch.num_tokens)  # [layers, T, heads, D]
            self.shard.free(fetch.req_id)  # a copy is in k, v
        except KeyError as exc:
            ack = KvSwapAck(fetch.req_id, self.cfg.head_start, self.cfg.head_end, str(exc))
            self._swap_sender().send_message(fetch.reply_to, ack, [])
            return
        for layer in range(k.shape[0]):
            pages = KvPages(
                fetch.req_id, layer, 1, fetch.num_tokens, self.cfg.head_start, self.cfg.head_end,
                k.shape[0], sent_at=time.monotonic(),
            )  # fmt: skip
            self._swap_sender().send(
                fetch.reply_to, pages, k[layer : layer + 1], v[layer : layer + 1]
            )

    def _swap_sender(self) -> KvSender:
        """The link back to token engines, for swaps (started on the first)."""
        if self.swap_sender is None:
            self.swap_sender = KvSender(self.cfg.host, bytes.fromhex(self.cfg.mesh_key))
        return self.swap_sender

    def _land_pages(self, pages: KvPages, tensors: list[torch.Tensor]) -> Landed:
        """Land KV pages; a request whose KV is now whole here, or refused, or did not fit, is
        news for the token engine (pages that do not fit raise after that)."""
        try:
            landed = self.shard.receive_kv(pages, *tensors)
        except ValueError:
            self.news.lost(pages.req_id)
            raise
        if landed is Landed.COMPLETE:
            self.news.landed(pages.req_id)
        elif landed is Landed.REFUSED:
            self.news.lost(pages.req_id)
        return landed


__all__ = ["ShardWorker"]
