"""A `ModelPeer` on its socket: listens on UCX for its token engine's link and answers each
`SliceRequest` in turn (services/engine/rotation.py is the other end).

One link at a time, as a shard serves its token engine: when the link closes (the engine stopped
or dropped this peer) it waits for the next. The newest link wins: a hello while a link is
served is accepted and the old link closed, because an engine that died (or restarted) may
leave its link open on this side, silent, for ever; a peer serves one engine (the registry's
claim), so a new link means that engine came back. A hello that fails the mesh key is dropped
and the old link served on. A malformed message closes the link (the stream may be
misaligned); a wrong one is answered with an error. It runs as an OS process
(`services.launch.worker_process`) or on a Ray Serve replica's thread (`services.mesh`); it holds
no state between slices, so killing it loses nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from common.config import cache_dir
from common.model.llama import LlamaForCausalLM
from common.model.loader import load_model
from common.protocol import PeerLinkMessage, SliceRequest, SliceResult
from common.transport.ucx_channel import ChannelClosed, UcxTensorChannel, refuse
from common.transport.ucx_listener import UcxListener
from common.worker_config import WorkerConfig, WorkerReady
from services.engine.model_peer import ModelPeer

log = structlog.get_logger(__name__)

POLL_S = 0.2  # idle wake-up to notice shutdown


class ModelPeerWorker:
    def __init__(self, cfg: WorkerConfig, model: LlamaForCausalLM | None = None) -> None:
        """`model`: already loaded (tests share one); default: loaded from `cfg.model_path`."""
        self.cfg = cfg
        if model is None:
            model = load_model(cfg.model_path, weight_cache=cache_dir(cfg.options.weight_cache))
        self.peer = ModelPeer(model)
        self.listener = UcxListener(PeerLinkMessage, cfg.host, bytes.fromhex(cfg.mesh_key))
        self.running = True
        self.last_pass = time.monotonic()

    def ready(self) -> WorkerReady:
        return WorkerReady(self.cfg.service_id, self.cfg.role,
                           link_address=self.listener.address)  # fmt: skip

    def run(self) -> None:
        link: UcxTensorChannel[PeerLinkMessage] | None = None
        while self.running:
            self.last_pass = time.monotonic()
            if link is None or self.listener.has_hello():
                link = self._accept(link)
            if link is not None and not serve_link(self.peer, link, self._serving):
                link.close()  # it ended: wait for the next
                link = None
        if link is not None:
            link.close()

    def _accept(
        self, link: UcxTensorChannel[PeerLinkMessage] | None
    ) -> UcxTensorChannel[PeerLinkMessage] | None:
        """The link to serve now: a new one if a hello checks out (the old one is closed), else
        `link` (a bad hello is dropped by the listener)."""
        try:
            new = self.listener.accept(timeout=POLL_S)
        except TimeoutError:
            return link
        if link is not None:
            log.warning("a new token engine link; closing the old one")
            link.close()
        return new

    def _serving(self) -> bool:
        """`serve_link`'s `running`: stop serving on shutdown or when a new link says hello."""
        self.last_pass = time.monotonic()  # health is progress (services/mesh/replica.py)
        return self.running and not self.listener.has_hello()


def serve_link(
    peer: ModelPeer,
    link: UcxTensorChannel[PeerLinkMessage],
    running: Callable[[], bool] = lambda: True,
) -> bool:
    """Answer slices on `link` until it ends (False: closed, or a message it could not receive) or
    `running()` turns false (True: the link may be served on). `running` is asked before each
    message and at least every POLL_S."""
    while running():
        try:
            header, tensors = link.recv(timeout=POLL_S)
        except TimeoutError:
            continue
        except ChannelClosed:
            log.info("token engine link closed; waiting for the next")
            return False
        except Exception as exc:  # noqa: BLE001 - malformed, or tensors that do not fit
            log.exception("message on the link not received; closing it")
            refuse(link, SliceResult(-1, -1, -1, error=f"message not received: {exc!r}"))
            return False  # answered for no step: the engine drops this peer at once
        if isinstance(header, SliceRequest):
            reply, outputs = peer.answer(header, tensors)
            if reply.error:
                log.warning("slice refused", step=header.step, lane=header.lane,
                            layer=header.layer, error=reply.error)  # fmt: skip
        else:  # answered, so that the engine is not left waiting for its timeout
            reply = SliceResult(-1, -1, -1, error=f"unexpected {type(header).__name__}")
            outputs = []
        try:
            link.send(reply, outputs)
        except (ChannelClosed, TimeoutError):
            log.info("token engine link lost while replying; waiting for the next")
            return False
    return True


__all__ = ["ModelPeerWorker", "serve_link"]
