"""A `ModelPeer` on its socket: listens on UCX for its token engine's link and answers each
`SliceRequest` in turn (services/engine/rotation.py is the other end).

One link at a time, as a shard serves its token engine: when the link closes (the engine stopped
or dropped this peer) it waits for the next. A malformed message closes the link (the stream may
be misaligned); a wrong one is answered with an error. It runs as an OS process
(`services.launch.worker_process`); it holds no state between slices, so killing it loses nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import structlog

from common.model.loader import load_model
from common.protocol import PeerLinkMessage, SliceRequest, SliceResult
from common.transport.ucx_channel import ChannelClosed, UcxTensorChannel
from common.transport.ucx_listener import UcxListener
from common.worker_config import WorkerConfig, WorkerReady
from services.engine.model_peer import ModelPeer

log = structlog.get_logger(__name__)

POLL_S = 0.2  # idle wake-up to notice shutdown


class ModelPeerWorker:
    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.peer = ModelPeer(load_model(cfg.model_path))
        self.listener = UcxListener(PeerLinkMessage, cfg.host, bytes.fromhex(cfg.mesh_key))
        self.running = True
        self.last_pass = time.monotonic()

    def ready(self) -> WorkerReady:
        return WorkerReady(self.cfg.service_id, str(self.cfg.role),
                           link_address=self.listener.address)  # fmt: skip

    def run(self) -> None:
        while self.running:
            self.last_pass = time.monotonic()
            try:
                link = self.listener.accept(timeout=POLL_S)
            except TimeoutError:
                continue
            serve_link(self.peer, link, lambda: self.running)
            link.close()


def serve_link(
    peer: ModelPeer,
    link: UcxTensorChannel[PeerLinkMessage],
    running: Callable[[], bool] = lambda: True,
) -> None:
    """Answer slices on `link` until it closes, a malformed message comes, or `running()` turns
    false."""
    while running():
        try:
            header, tensors = link.recv(timeout=POLL_S)
        except TimeoutError:
            continue
        except ChannelClosed:
            log.info("token engine link closed; waiting for the next")
            return
        except msgspec.DecodeError:
            log.exception("malformed message on the link; closing it")
            return
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
            return


__all__ = ["ModelPeerWorker", "serve_link"]
