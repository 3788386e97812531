"""A client that talks to a `LocalMesh`'s engines directly, with no router: for tests and benches.

It places requests round-robin (not the router's JSQ) and returns raw `TokenOutput`s, so a test
can check the engines' token streams without the HTTP layer in between.
"""

from __future__ import annotations

import itertools
import time

import zmq

from common.protocol import (
    AbortRequest,
    GenerateRequest,
    SamplingSpec,
    ServiceReply,
    TokenBatch,
    TokenOutput,
)
from common.token_stream import TokenStreamOrderer
from common.transport.zmq_sockets import PushPool, TypedSocket, bind_random
from services.launch.local_mesh import LocalMesh
from services.mesh.registry import ServiceEntry


class MeshTestClient:
    """Submits requests to a mesh and collects their token streams (round-robin placement)."""

    def __init__(self, mesh: LocalMesh) -> None:
        self.mesh = mesh
        ctx: zmq.Context = zmq.Context.instance()
        sock, self.reply_endpoint = bind_random(ctx, zmq.PULL, auth=mesh.auth)
        self.replies: TypedSocket[ServiceReply] = TypedSocket(sock, ServiceReply)
        self.push: PushPool[object] = PushPool(ctx, object, auth=mesh.auth)
        self._prompt_rr = itertools.cycle(mesh.prompt)
        self._token_rr = itertools.cycle(mesh.token)
        self.placement: dict[str, tuple[ServiceEntry, ServiceEntry]] = {}
        self.orderer = TokenStreamOrderer()

    def submit(
        self,
        req_id: str,
        prompt: list[int],
        sampling: SamplingSpec,
        traceparent: str = "",
        token_engine: ServiceEntry | None = None,
    ) -> None:
        """`traceparent`: the request's trace context (`inject_context()`), as a router sends it;
        `token_engine`: where it decodes (default: the next one, round-robin)."""
        pe, te = next(self._prompt_rr), token_engine or next(self._token_rr)
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

    def close(self) -> None:
        self.replies.close()
        self.push.close()
