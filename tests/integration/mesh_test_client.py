"""A client that talks to a `LocalMesh`'s engines directly, with no router: for tests.

It places requests as the router does, by JSQ: the router's `ClusterScheduler` (Splitwise's
`JSQPoolPolicy`, with its mixed-pool borrowing) fed the engines' own `LoadReport`s, to which it
subscribes as `services/router/mesh_inbox.py` does. Like the router, it sends the pool changes
the scheduler asks for (`SetRole`: lend, renew, return) on every placement and refresh. It
returns raw `TokenOutput`s, so a test can check the engines' token streams without the HTTP
layer in between. Benches and the demo drive a mesh with the router's own client instead
(`LocalMesh.engine_client`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from common.protocol import (
    AbortRequest,
    GenerateRequest,
    LoadReport,
    SamplingSpec,
    ServiceReply,
    TokenBatch,
    TokenOutput,
)
from common.scheduling.cluster import MachineLoad, PoolThresholds
from common.token_stream import TokenStreamOrderer
from common.transport.zmq_sockets import PushPool, TypedSocket, bind_random
from services.launch.local_mesh import LocalMesh
from services.mesh.registry import ServiceEntry
from services.router.cluster_scheduler import ClusterScheduler


class MeshTestClient:
    """Submits requests to a mesh and collects their token streams (JSQ placement)."""

    def __init__(self, mesh: LocalMesh, thresholds: PoolThresholds | None = None) -> None:
        self.mesh = mesh
        ctx: zmq.Context = zmq.Context.instance()
        sock, self.reply_endpoint = bind_random(ctx, zmq.PULL, auth=mesh.auth)
        self.replies: TypedSocket[ServiceReply] = TypedSocket(sock, ServiceReply)
        self.push: PushPool[object] = PushPool(ctx, object, auth=mesh.auth)
        self.scheduler = ClusterScheduler(
            mesh.topology.options.block_size, thresholds, reply_endpoint=self.reply_endpoint
        )
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        mesh.auth.join(sub)
        self.load_reports: TypedSocket[LoadReport] = TypedSocket(sub, LoadReport)
        self._subscribed: set[str] = set()
        self.last_reports: dict[str, LoadReport] = {}  # each engine's latest, once one came in
        self.roles_seen: dict[str, list[str]] = {}  # each engine's reported pools, in order
        self.placement: dict[str, tuple[ServiceEntry, ServiceEntry]] = {}
        self.orderer = TokenStreamOrderer()
        self.refresh()

    def refresh(self) -> None:
        """Take the mesh's engines as the registry lists them now (restarts included) and every
        load report that has come in."""
        engines = [*self.mesh.prompt, *self.mesh.token]
        self.scheduler.set_engines([*engines, *self.mesh.shards])
        for e in engines:
            if e.load_endpoint and e.load_endpoint not in self._subscribed:
                self.load_reports.sock.connect(e.load_endpoint)
                self._subscribed.add(e.load_endpoint)
        while (report := self.load_reports.recv_nowait()) is not None:
            self.scheduler.on_load(report[1])
            self.last_reports[report[1].engine_id] = report[1]
            seen = self.roles_seen.setdefault(report[1].engine_id, [])
            if not seen or seen[-1] != report[1].role:
                seen.append(report[1].role)
        self.scheduler.rebalance()
        self.send_role_changes()

    def send_role_changes(self) -> None:
        for engine, change in self.scheduler.take_role_changes():
            self.push.get(engine.command_endpoint).send(change)

    def wait_for_loads(
        self, check: Callable[[dict[str, MachineLoad]], bool], timeout: float = 30.0
    ) -> dict[str, MachineLoad]:
        """Block on the load reports until `check(loads)` holds; the loads then."""
        deadline = time.monotonic() + timeout
        while not check(loads := self.loads()):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the engines' load reports did not satisfy {check} in time")
            self.load_reports.sock.poll(int(left * 1000))
        return loads

    def loads(self) -> dict[str, MachineLoad]:
        """The scheduler's current estimate per engine service id (after a `refresh`)."""
        self.refresh()
        return self.scheduler.loads()

    def submit(
        self,
        req_id: str,
        prompt: list[int],
        sampling: SamplingSpec,
        traceparent: str = "",
        refresh: bool = True,
        token_engine: ServiceEntry | None = None,
    ) -> None:
        """`traceparent`: the request's trace context (`inject_context()`), as a router sends it.
        `refresh=False` places on the loads as last refreshed (plus what was placed since), as a
        router does when a burst comes in faster than the engines report. `token_engine`: where
        it decodes, instead of where JSQ would place it (a test's choice)."""
        if refresh:
            self.refresh()
        pe, te = self.scheduler.choose(len(prompt))
        self.send_role_changes()  # an engine lent for this request hears it first
        te = token_engine or te
        self.placement[req_id] = (pe, te)
        msg = GenerateRequest(
            req_id=req_id, prompt_token_ids=prompt, sampling=sampling,
            reply_to=self.reply_endpoint, token_engine=te.command_endpoint,
            token_kv_endpoint=te.kv_endpoint, token_kv_address=te.kv_address,
            shards=list(te.shards), traceparent=traceparent,
        )  # fmt: skip
        self.push.get(pe.command_endpoint).send(msg)

    def abort(self, req_id: str) -> None:
        """Abort at the prompt engine and the token engine; the token engine frees the shards."""
        pe, te = self.placement[req_id]
        self.push.get(pe.command_endpoint).send(AbortRequest(req_id))
        self.push.get(te.command_endpoint).send(AbortRequest(req_id))

    def recv(self, timeout: float = 30.0) -> TokenOutput:
        """The next token message from any request, in each request's token order."""
        deadline = time.monotonic() + timeout
        while not self.orderer.ready:
            item = self.replies.recv_nowait()
            if item is not None and isinstance(item[1], TokenOutput | TokenBatch):
                for out in item[1].outputs() if isinstance(item[1], TokenBatch) else [item[1]]:
                    self.orderer.push(out)
                continue
            left = deadline - time.monotonic()
            if left <= 0 or not self.replies.sock.poll(int(left * 1000)):
                raise TimeoutError(f"no tokens from the mesh in {timeout} s")
        return self.orderer.ready.popleft()

    def finish(self, req_id: str, timeout: float = 120.0) -> tuple[list[int], TokenOutput]:
        """Every token of `req_id`, the only request in flight, and its last message."""
        tokens: list[int] = []
        while True:
            out = self.recv(timeout)
            assert out.req_id == req_id, f"a message for {out.req_id} while only {req_id} runs"
            tokens += out.token_ids
            if out.finish_reason:
                return tokens, out

    def close(self) -> None:
        self.replies.close()
        self.load_reports.close()
        self.push.close()
