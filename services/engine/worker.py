"""An `Engine` on its sockets: `EngineWorker` binds ZeroMQ, links to its shards over UCX, and loops.

The loop blocks in `zmq.Poller.poll` while idle and never sleep-polls; between steps it drains
commands, KV pages (received over UCX on another thread: `kv_ports.py`) and stats requests, and
every 50 ms publishes a load report and frees KV whose hand-off never came (its lease ran out).
It runs as an OS process (`services.launch.worker_process`) or on a Ray Serve replica's thread
(`services.mesh`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import msgspec
import structlog
import torch
import zmq

from common.block_manager import BlockManager
from common.engine.grammars import GrammarWaits
from common.kv_events import CacheDigests
from common.kv_hold import KvHold
from common.protocol import (
    AbortRequest,
    DecodeHandoff,
    EngineCommand,
    FreeRequest,
    GenerateRequest,
    KvAnnounce,
    KvControl,
    KvPages,
    KvRebuilt,
    KvSwapAck,
    LinkPeers,
    LinkShards,
    LoadReport,
    PeerLinkMessage,
    RebuildKv,
    ServiceReply,
    SetRole,
    ShardAddress,
    ShardIngress,
    ShardLinkMessage,
    Shutdown,
    StatsRequest,
    TokenBatch,
)
from common.roles import Role
from common.transport.ucx_channel import ChannelClosed, UcxTensorChannel
from common.transport.zmq_sockets import PushPool, TypedSocket, bind_random
from common.worker_config import WorkerConfig, WorkerReady
from services.engine.dropped_outputs import DroppedOutputs
from services.engine.engine import Engine
from services.engine.faults import EngineFaults
from services.engine.kv_hold_server import KvHoldServer
from services.engine.kv_ports import EngineKvPorts
from services.engine.outbox import Outbox
from services.engine.parts import build_engine_parts
from services.engine.peer_watch import PeerWatch
from services.engine.rotation import ModelPeers
from services.engine.runner import ShardLink, ShardLinkFault
from services.engine.shard_linker import ShardLinker
from services.engine.shard_round_trip import ShardLost
from services.engine.telemetry import EngineTelemetry

log = structlog.get_logger(__name__)

# With no work, the loop blocks on its sockets (a message wakes it at once) until its next load
# report: at most `IDLE_POLL_MS` while news from work or a notice to a router waits to go, else
# until the idle report is due (`idle_wait_ms`). It never busy-polls.
IDLE_POLL_MS = 200
LOAD_REPORT_INTERVAL_S = 0.05
# An engine with no work since its last report publishes every second: nothing moves, and each
# report is a decode for every router (its /metrics drops an engine silent for 5 s). Work, or
# the end of it, is reported at the busy pace again at once.
IDLE_REPORT_INTERVAL_S = 1.0
PEER_CONNECT_TIMEOUT_S = 2.0  # a model peer that does not answer a new link is left out
# At start, a shard that does not answer a link is tried again until this deadline: while every
# service of a mesh starts at once on few cores, a live shard can be slow to get to its listener,
# and giving up would end the engine (its process exits, its replica restarts).
SHARD_LINK_START_DEADLINE_S = 60.0


class EngineWorker:
    """Sockets and loop around an `Engine`."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        # First: a start that fails here (no shard answered in time) leaves no socket behind.
        self.links: dict[str, ShardLink] = dict(self._link_at_start(cfg.shards))
        # Later links are made off the loop (shard_linker.py): a group asked for (`_target`)
        # is swapped in once all its links are at hand; the links made so far wait in `_spare`.
        self.linker = ShardLinker(self._connect)
        self._spare: dict[str, ShardLink] = {}
        self._target: tuple[list[ShardAddress], str, tuple[str, ...]] | None = None
        self._rebuilders: list[str] = []  # prompt engines that may rebuild lost heads (last told)
        self.ctx = zmq.Context()
        auth = cfg.curve_keys  # every socket: only the mesh's members get through (zmq_auth.py)
        cmd, self.command_endpoint = bind_random(self.ctx, zmq.PULL, cfg.host, auth=auth)
        kv, self.kv_endpoint = bind_random(self.ctx, zmq.PULL, cfg.host, auth=auth)
        ctl, self.control_endpoint = bind_random(self.ctx, zmq.ROUTER, cfg.host, auth=auth)
        pub, self.load_endpoint = bind_random(self.ctx, zmq.PUB, cfg.host, auth=auth)
        self.commands: TypedSocket[EngineCommand] = TypedSocket(cmd, EngineCommand)
        # KV pages over UCX: the ZeroMQ socket then takes only frees (a KvPages there is dropped).
        self.kv_in: TypedSocket[ShardIngress] = TypedSocket(
            kv, KvControl if cfg.options.kv_over_ucx else ShardIngress
        )
        self.kv_ports = EngineKvPorts(cfg)
        self.control: TypedSocket[StatsRequest] = TypedSocket(ctl, StatsRequest)
        self.replies: TypedSocket[ServiceReply] = TypedSocket(ctl, ServiceReply)
        self.load_pub: TypedSocket[LoadReport] = TypedSocket(pub, LoadReport)
        self.last_load: LoadReport | None = None
        self.peers = PeerWatch()  # peers lost: routers' requests end, sockets close (peer_watch.py)
        self.dropped = DroppedOutputs(self.ctx, auth, cfg.service_id)  # routers' given-up requests
        self.push: PushPool[object] = PushPool(self.ctx, object, on_new=self.peers.watch, auth=auth)
        self.kv_push: PushPool[ShardIngress] = PushPool(
            self.ctx, ShardIngress, on_new=self.peers.watch, auth=auth
        )
        # `kv_transfer: pull`: shards' KV is held here and pulled by them (kv_hold_server.py).
        opts = cfg.options
        pulls = opts.kv_transfer == "pull" and cfg.role in (Role.PROMPT, Role.MIXED)
        self.kv_hold = KvHoldServer(KvHold(opts.kv_hold_bytes), cfg.host, auth) if pulls else None
        telemetry = EngineTelemetry(
            cfg.service_id, cfg.model_name, shards=[s.service_id for s in cfg.shards]
        )
        parts = build_engine_parts(
            cfg.service_id, cfg.role, opts, cfg.model_path, self._send_kv,
            command_endpoint=self.command_endpoint, kv_address=self.kv_ports.address,
            shard_links=list(self.links.values()), shards=cfg.shards, telemetry=telemetry,
        )  # fmt: skip
        self.engine = Engine(parts)
        self.faults = EngineFaults(self.engine)  # its fault inputs, called from this loop
        # Requests whose grammar compiles off this loop (common/engine/grammars.py).
        self.grammar_waits: GrammarWaits[EngineCommand] = GrammarWaits(parts.table.grammars)
        if cfg.model_peers:  # Lamina 4.3 over replicas: lanes' slices rotate (rotation.py)
            self.engine.runner.use_peers(self._link_peers(cfg.model_peers))
        self.running = True
        self.last_pass = time.monotonic()
        self._last_report = 0.0
        self._worked = True  # work since the last load report (the first one goes at once)
        self._last_load_s = 0.0
        self._unreachable: set[str] = set()  # endpoints already warned about
        self.digests = CacheDigests()  # its prefix cache's news, on every load report

    def _link_peers(self, addresses: list[str]) -> ModelPeers:
        """Links to the model peers that answer; one that does not is left out (logged) until
        the next `LinkPeers` lists it."""
        mc = self.engine.runner.model.config
        heads = (mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim)
        peers = ModelPeers([], heads, self.cfg.options.shard_reply_timeout_s)
        peers.relink(addresses, self._connect_peer)
        return peers

    def _connect_peer(self, address: str) -> UcxTensorChannel[PeerLinkMessage]:
        # NOTE: blocks the loop (between steps) for at most PEER_CONNECT_TIMEOUT_S per peer that
        # does not answer; a peer the registry still lists is alive, so this is rare.
        return UcxTensorChannel.connect(
            address, PeerLinkMessage, host=self.cfg.host, key=bytes.fromhex(self.cfg.mesh_key),
            timeout=PEER_CONNECT_TIMEOUT_S,
        )  # fmt: skip

    def _relink_peers(self, addresses: list[str]) -> None:
        """`LinkPeers`: between steps (the loop drains commands there), the rotation's peers
        become `addresses` (rotation.py `relink`)."""
        runner = self.engine.runner
        if runner.model_peers is None:  # none at start (Ray: peers still starting)
            runner.use_peers(self._link_peers(addresses))
        else:
            runner.model_peers.relink(addresses, self._connect_peer)

    def ready(self) -> WorkerReady:
        return WorkerReady(
            self.cfg.service_id, self.cfg.role, self.command_endpoint, self.kv_endpoint,
            self.control_endpoint, self.load_endpoint, kv_address=self.kv_ports.address,
        )  # fmt: skip

    def _connect(self, shard: ShardAddress) -> UcxTensorChannel[ShardLinkMessage]:
        return UcxTensorChannel.connect(
            shard.link_address, ShardLinkMessage, timeout=self.cfg.options.shard_link_timeout_s,
            host=self.cfg.host, key=bytes.fromhex(self.cfg.mesh_key),
        )  # fmt: skip

    def _link_at_start(
        self, shards: list[ShardAddress]
    ) -> dict[str, UcxTensorChannel[ShardLinkMessage]]:
        """A link to every shard of the group; past the start deadline, ChannelClosed (a shard
        that never answers: stopped, another mesh's key). A shard that is gone (its address
        unreachable) or an address that is not one raises at once, as `connect` does."""
        deadline = time.monotonic() + SHARD_LINK_START_DEADLINE_S
        links: dict[str, UcxTensorChannel[ShardLinkMessage]] = {}
        try:
            for shard in shards:
                links[shard.link_address] = self._connect_by(shard, deadline)
        except BaseException:
            for link in links.values():
                link.close()
            raise
        return links

    def _connect_by(
        self, shard: ShardAddress, deadline: float
    ) -> UcxTensorChannel[ShardLinkMessage]:
        """`_connect`, tried again while it times out and `deadline` has not passed. A late
        answer to an earlier try is harmless: the shard serves the newest hello that checks out
        and drops one whose peer gave up."""
        while True:
            try:
                return self._connect(shard)
            except ChannelClosed as exc:
                if time.monotonic() >= deadline:
                    raise
                log.warning("shard did not answer the link yet; trying again",
                            shard=shard.service_id, error=repr(exc))  # fmt: skip

    def _send_kv(
        self, dest: ShardAddress, pages: KvPages, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        # Over UCX where the receiver listens for KV; a transfer that fails ends its request
        # retryably (`_tick`). On ZeroMQ, KV that cannot be sent is dropped: its decode step fails
        # on the shard (KV_WAIT_S) or its hand-off times out, and the request is re-run elsewhere.
        hold = None if self.engine.is_rebuild(pages.req_id) else self.kv_hold
        if pages.reserve_tokens and hold is not None and hold.hold.put(pages, k, v):
            # Held for the shard to pull; announced once whole (before the hand-off leaves).
            if hold.hold.is_complete(pages.req_id, dest.head_start, dest.head_end):
                announce = KvAnnounce(
                    pages.req_id, hold.endpoint, dest.head_start, dest.head_end,
                    traceparent=pages.traceparent,  # the shard's kv.pull span joins the trace
                )  # fmt: skip
                self._delivered(dest.kv_endpoint, announce, tensors=[])
        elif dest.kv_address:
            self.kv_ports.send(dest.kv_address, pages, k, v)
        else:
            self._delivered(dest.kv_endpoint, pages, tensors=[k, v])

    def run(self) -> None:
        poller = zmq.Poller()
        for sock in (self.commands.sock, self.kv_in.sock, self.control.sock):
            poller.register(sock, zmq.POLLIN)
        if self.kv_ports.inbox is not None:
            poller.register(self.kv_ports.inbox, zmq.POLLIN)
        poller.register(self.grammar_waits.fileno(), zmq.POLLIN)
        poller.register(self.linker.fileno(), zmq.POLLIN)
        while self.running:
            self.last_pass = time.monotonic()  # health is progress (services/mesh/replica.py)
            if poller.poll(0 if self.engine.has_work() else self.idle_wait_ms()):
                self._worked = True  # a message may change the load (a request, KV, a free)
            self._drain()
            if self.engine.has_work():
                self._worked = True
                self._step()
            self._tick()
        self.peers.close()
        self.dropped.close()
        self.linker.close()
        for link in [*self.links.values(), *self._spare.values()]:
            link.close()
        if self.engine.runner.model_peers is not None:
            self.engine.runner.model_peers.close()
        self.kv_ports.close()
        if self.kv_hold is not None:
            self.kv_hold.close()
        self.grammar_waits.close()
        self.ctx.destroy(linger=0)

    def _step(self) -> None:
        try:
            self._send(self.engine.step())
        except ShardLost as exc:
            # Shards of the group died mid-step: the survivors keep their heads' KV (their
            # links stay open) and the lost heads are rebuilt, or the group's requests re-run.
            log.error("shard lost", shards=sorted(exc.shards), error=repr(exc))
            group = list(self.engine.shards)
            self._send(self.faults.shard_lost(exc.shards, time.monotonic()))
            self._keep_links([])
            # A lost shard may still run (only its link broke): the same group is linked again
            # off this loop, and the lost heads rebuilt onto it; a dead one's replacement comes
            # from its keeper (`LinkShards`) and takes the place of this target.
            self._relink(group, "its shard links were made again", self._rebuilders)
        except (ChannelClosed, ShardLinkFault) as exc:
            # A shard died mid-step (ChannelClosed), or a reply came late or stale (the links
            # cannot be trusted; the shards may be fine). The group's requests end retryably
            # (the router re-runs them), this engine decodes locally, and fresh links to the
            # same shards are made off this loop: a shard that still runs (its link broke, it
            # was stopped for a while) is linked again; one that died is replaced by its keeper.
            log.error("shard link failed; dropping the group and linking it again",
                      error=repr(exc))  # fmt: skip
            # Closed links free the survivors' KV: a rebuild under way cannot go on.
            self._send(self.faults.abandon_rebuild(f"its shard links failed: {exc!r}"))
            group = self._target[0] if self._target is not None else list(self.engine.shards)
            self._relink([], f"its shard links failed: {exc!r}")
            self._relink(group, "its shard links were made again")
        except Exception as exc:  # noqa: BLE001 - fail the requests, keep the service alive
            log.exception("engine step failed; failing its requests")
            self._send(self.faults.fail_all(f"engine {self.cfg.service_id}: {exc!r}"))

    def _relink(
        self, shards: list[ShardAddress], reason: str, rebuilders: Sequence[str] = ()
    ) -> None:
        """The group becomes `shards`: at once when every link is at hand, else once the links
        it lacks are made off this loop (`ShardLinker`); the current group serves meanwhile.
        Links the new group does not use are closed when it is swapped in. `rebuilders`: prompt
        engines that may rebuild lost heads (`LinkShards`)."""
        self._target = (list(shards), reason, tuple(rebuilders))
        missing = [s for s in shards if s.link_address not in self.links | self._spare]
        for address in [a for a in self._spare if a not in {s.link_address for s in shards}]:
            self._spare.pop(address).close()
        self.linker.want(missing)
        if not missing:
            self._swap_in()

    def _take_links(self) -> None:
        """Links the linker made: kept until their group is whole, then swapped in."""
        made = self.linker.ready()
        self._spare.update(made)
        if made and self._target is not None:
            missing = [s for s in self._target[0] if s.link_address not in self.links | self._spare]
            if not missing:
                self._swap_in()

    def _swap_in(self) -> None:
        """Between steps: decode against the target group from now on (`faults.relink` ends
        the requests tied to the old one, or resumes a rebuild)."""
        assert self._target is not None
        shards, reason, rebuilders = self._target
        self._target = None
        self._keep_links(shards)
        for shard in shards:
            if shard.link_address not in self.links:
                self.links[shard.link_address] = self._spare.pop(shard.link_address)
        links = [self.links[s.link_address] for s in shards]
        self._send(self.faults.relink(links, shards, reason, rebuilders))
        self._keep_links(shards)  # survivors a rebuild that fell back holds no longer

    def _keep_links(self, shards: list[ShardAddress]) -> None:
        """Close every link but those to `shards` and to the survivors of a group whose lost
        heads are being rebuilt (a shard frees what a closed link decoded: shard_rebuild.py)."""
        keep = {s.link_address for s in [*shards, *self.engine.rebuilds.held()]}
        for address in [a for a in self.links if a not in keep]:
            self.links.pop(address).close()

    def _drain(self) -> None:
        # A message that fails (well-formed on the wire, wrong inside: KV pages whose tensors do
        # not match their header, say) is logged and dropped: the loop and its requests go on.
        while (item := self.commands.recv_nowait()) is not None:
            self._guarded(self._on_command, item[1])
        self._take_links()
        for command in self.grammar_waits.ready():  # its grammar compiled: quick to add now
            self._guarded(self._dispatch, command)
        for header, tensors in self.kv_ports.received():
            self._guarded(self._on_ingress, header, tensors)
        while (kv := self.kv_in.recv_tensors_nowait()) is not None:
            self._guarded(self._on_ingress, *kv)
        while (req := self.control.recv_nowait()) is not None:
            self.replies.send(self.engine.stats(), prefix=req[0])

    def _guarded(self, handle: Callable[..., None], message: object, *more: object) -> None:
        try:
            handle(message, *more)
        except Exception:  # noqa: BLE001 - one bad message must not stop the engine
            log.exception("message failed; dropped", kind=type(message).__name__)

    def _on_ingress(self, header: ShardIngress, tensors: list[torch.Tensor]) -> None:
        if isinstance(header, KvPages) and len(tensors) == 2:
            self._send(self.engine.on_kv(header, *tensors))
        elif isinstance(header, FreeRequest):
            self.grammar_waits.drop(header.req_id)
            self._send(self.engine.on_abort(header.req_id))
        elif isinstance(header, KvSwapAck):
            self._send(self.engine.on_swap_ack(header))
        else:
            log.warning("dropped unexpected ingress message", kind=type(header).__name__)

    def _on_command(self, msg: EngineCommand) -> None:
        if isinstance(msg, GenerateRequest | DecodeHandoff):
            spec = msg.sampling.structured_output or None
            if self.grammar_waits.hold(msg.req_id, spec, msg):
                return  # back through `_drain` once its spec is compiled
        elif isinstance(msg, AbortRequest):
            self.grammar_waits.drop(msg.req_id)
        self._dispatch(msg)

    def _dispatch(self, msg: EngineCommand) -> None:
        if isinstance(msg, GenerateRequest):
            self._send(self.engine.on_generate(msg))
        elif isinstance(msg, DecodeHandoff):
            self._send(self.engine.on_handoff(msg))
        elif isinstance(msg, AbortRequest):
            self._send(self.engine.on_abort(msg.req_id))
        elif isinstance(msg, SetRole):
            self.engine.on_set_role(msg)
        elif isinstance(msg, LinkShards):
            self._rebuilders = list(msg.rebuilders)
            self._relink(list(msg.shards), "its shard group changed", self._rebuilders)
        elif isinstance(msg, RebuildKv):
            self._send(self.engine.on_rebuild(msg))
        elif isinstance(msg, KvRebuilt):
            self._send(self.faults.kv_rebuilt(msg))
        elif isinstance(msg, LinkPeers):
            self._relink_peers(list(msg.peers))
        elif isinstance(msg, Shutdown):
            self.running = False

    def _send(self, outbox: Outbox, retry: bool = True) -> None:
        """Send without ever blocking the loop (`PushPool`). What a peer cannot take means it is
        gone or stopped reading: a router's request is aborted here (its KV freed) and the
        router told on a socket of its own (`DroppedOutputs`), a token engine's hand-off goes
        back to the router as a retryable error, and a free is left to the shard's lease."""
        fallout = Outbox()
        for endpoint, output in outbox.wire_outputs():
            if not self._delivered(endpoint, output):
                req_ids = output.req_ids if isinstance(output, TokenBatch) else [output.req_id]
                for req_id in req_ids:
                    fallout += self.engine.on_abort(req_id)
                self.dropped.add(endpoint, req_ids)  # the router hears of it (dropped_outputs.py)
        for endpoint, handoff in outbox.handoffs:
            if not self._delivered(endpoint, handoff):
                fallout += self.faults.undelivered_handoff(handoff)
        for endpoint, free in outbox.frees:  # KV-ingress sockets take tensor messages only
            self._delivered(endpoint, free, tensors=[])
        for endpoint, rebuild in outbox.rebuilds:  # a lost `KvRebuilt` is left to the bound
            if not self._delivered(endpoint, rebuild) and isinstance(rebuild, RebuildKv):
                unreachable = KvRebuilt(rebuild.req_id, "its prompt engine is unreachable")
                fallout += self.faults.kv_rebuilt(unreachable)
        if fallout and retry:
            self._send(fallout, retry=False)
        if self.dropped:
            self.dropped.flush()

    def _delivered(
        self, endpoint: str, message: object, tensors: list[torch.Tensor] | None = None
    ) -> bool:
        """Queue `message` for `endpoint` (on its KV-ingress socket when it has `tensors`)."""
        try:
            if tensors is None:
                self.push.get(endpoint).send(message)
            else:
                self.kv_push.get(endpoint).send_tensors(message, tensors)  # type: ignore[arg-type]
        except zmq.Again:
            if endpoint not in self._unreachable:
                self._unreachable.add(endpoint)
                log.warning("peer not taking messages; dropping what is for it", endpoint=endpoint)
            return False
        self._unreachable.discard(endpoint)
        return True

    def idle_wait_ms(self) -> int:
        """How long the loop may block with no work: `IDLE_POLL_MS` while a report at the busy
        pace (after work) or a dropped-output notice is due, else until the idle report's time
        (at least `IDLE_POLL_MS`: the faults' deadlines are seconds)."""
        if self._worked or self.dropped:
            return IDLE_POLL_MS
        due_s = self._last_load_s + IDLE_REPORT_INTERVAL_S - time.monotonic()
        return max(IDLE_POLL_MS, int(due_s * 1000))

    def _tick(self) -> None:
        now = time.monotonic()
        if now - self._last_report >= LOAD_REPORT_INTERVAL_S:
            self._last_report = now
            if self.dropped:  # a router that was not taking the notice may take it now
                self.dropped.flush()
            self._send(self.faults.expire(now))
            for req_id in self.kv_ports.undelivered():
                self._send(self.faults.kv_undelivered(req_id))
            for endpoint in self.peers.lost(now):
                self._send(self.faults.lost_reply_to(endpoint))
                self.push.drop(endpoint)  # the gone peer's socket and queue (peer_watch.py)
                self.dropped.forget(endpoint)
                self.kv_push.drop(endpoint)
            if self._worked or now - self._last_load_s >= IDLE_REPORT_INTERVAL_S:
                self._publish_load(now)

    def _publish_load(self, now: float) -> None:
        self._worked, self._last_load_s = self.engine.has_work(), now
        report = self.engine.load_report(time.time())
        self.last_load = report  # for Serve's autoscaling hook (services/mesh/autoscaling.py)
        self.load_pub.send(with_cache_digest(report, self.digests, self.engine.blocks, now))
        self.engine.telemetry.report(report, self.engine.blocks.num_used_blocks)


def with_cache_digest(
    report: LoadReport, digests: CacheDigests, blocks: BlockManager, now_s: float
) -> LoadReport:
    """`report`, going out at `now_s` (monotonic), carrying the prefix cache's news since the
    last one (KV-aware routing)."""
    digest = digests.next(blocks.cached_hashes(), now_s)
    return msgspec.structs.replace(
        report, kv_seq=digest.seq, kv_snapshot=digest.snapshot, kv_added=digest.added,
        kv_removed=digest.removed,
    )  # fmt: skip
