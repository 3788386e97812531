"""A token engine's model peers: Lamina 4.3's rotation of decode lanes over model replicas.

With R = 1 + len(peers) replicas (the token engine is replica 0), lane j's slice k (the
post_attention of layer k - 1 and the pre_attention of layer k: model_peer.py) runs on replica
(j + k) mod R; the engine runs the last post_attention, the logits and sampling. While a lane's
slice is on a peer, the engine's other lanes run (lanes.py): with n = R + 1 lanes each replica
has a lane to run while one waits for its shards, as in Lamina's n batches over n - 1 replicas.

NOTE: a deviation from Lamina, where a batch's context moves from replica to replica and the
replicas talk to the memory devices directly: here the context goes engine -> peer -> engine
each slice, and q/k/v reach the shards through the engine, the shards' replies too. The shards
serve one link (their token engine's) and stay unchanged, and a peer's failure stays simple: the
engine still holds the lane's context (its sends must outlive the transfer anyway), so a peer
that dies, stays silent past the reply timeout, or answers wrongly (an error, or another step,
lane or layer: a fault, never data) is dropped and the engine runs the slice itself. No request
fails for it; the rotation shrinks from the next step on (docs/mesh.md).

Re-linking: whoever keeps the engine's peers (the registry's `services.mesh.peer_group` on Ray,
the supervisor of the local launcher) tells the engine its peers' addresses (`LinkPeers`), on a
change and again periodically. Between steps, `relink` keeps the links it has to listed peers,
closes the rest, and links to each listed peer it lacks: a replacement, or the same peer back
after a fault. The rotation grows again from the next step. A peer that does not answer the new
link is left out until the next `LinkPeers`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any, Protocol

import structlog
import torch

from common.protocol import SliceRequest, SliceResult
from common.transport.tensor_frames import TensorLink
from services.engine.model_peer import Slice

log = structlog.get_logger(__name__)


class PeerLink(TensorLink, Protocol):
    """A token engine's channel to one model peer (a `UcxTensorChannel` of `PeerLinkMessage`)."""

    def close(self) -> None: ...


@dataclass
class SliceInFlight:
    """A lane's slice between its send to a peer and the peer's reply: what `receive` needs."""

    peer: int
    handle: Any
    request: SliceRequest
    x: torch.Tensor  # what was sent: the reply's x has its shape and dtype
    sent_at: float


@dataclass
class PeerCounts:
    """Slices run on peers, and peers lost, since start (for tests and stats)."""

    num_slices: int = 0
    num_lost: int = 0
    num_joined: int = 0  # links made by `relink`: the first ones, peers back, replacements
    peer_s: float = 0.0  # send to reply, summed


class ModelPeers:
    """The engine's links to its model peers, in replica order (peer i is replica i + 1)."""

    def __init__(
        self,
        links: Seq[PeerLink],
        heads: tuple[int, int, int],
        reply_timeout_s: float = 30.0,
        addresses: Seq[str] = (),
    ) -> None:
        """`heads`: the model's (query heads, KV heads, head dim), to check replies' q/k/v;
        `addresses[i]`: where `links[i]` goes (for `relink`; default: unnamed)."""
        self.links: list[PeerLink] = list(links)
        self.addresses: list[str] = list(addresses) or [f"#{i}" for i in range(len(links))]
        if len(self.addresses) != len(self.links):
            raise ValueError(f"{len(self.links)} links, {len(self.addresses)} addresses")
        self.heads = heads
        self.reply_timeout_s = reply_timeout_s
        self.lost: set[int] = set()  # dropped during the current step; pruned before the next
        self.counts = PeerCounts()

    def __len__(self) -> int:
        return len(self.links)

    def prune(self) -> None:
        """Before a step: forget the peers lost in the last one (the rotation shrinks)."""
        if self.lost:
            kept = [i for i in range(len(self.links)) if i not in self.lost]
            self.links = [self.links[i] for i in kept]
            self.addresses = [self.addresses[i] for i in kept]
            self.lost.clear()

    def relink(self, addresses: Seq[str], connect: Callable[[str], PeerLink]) -> list[str]:
        """Between steps: peers at exactly `addresses`, in that order. Links to listed peers
        stay; the others are closed; a listed peer without a live link gets a new one from
        `connect` (one that raises is left out, logged). Returns the addresses newly linked."""
        self.prune()
        have = dict(zip(self.addresses, self.links, strict=True))
        for address in [a for a in have if a not in addresses]:
            self._close(have.pop(address))
        links, linked, joined = [], [], []
        for address in dict.fromkeys(addresses):  # NOTE: a peer listed twice is linked once
            link = have.get(address)
            if link is None:
                try:
                    link = connect(address)
                except Exception as exc:  # noqa: BLE001 - not back yet: the next LinkPeers
                    log.warning("model peer not linked; its slices run on the engine",
                                peer=address[:16], error=repr(exc))  # fmt: skip
                    continue
                joined.append(address)
            links.append(link)
            linked.append(address)
        self.links, self.addresses = links, linked
        self.counts.num_joined += len(joined)
        if joined:
            log.info("model peers linked; they rejoin the rotation", num_peers=len(links),
                     joined=[a[:16] for a in joined])  # fmt: skip
        return joined

    def peer_of(self, lane: int, layer: int) -> int | None:
        """The peer that runs `lane`'s slice `layer`, or None: the engine runs it."""
        replica = (lane + layer) % (1 + len(self.links))
        peer = replica - 1
        return peer if replica and peer not in self.lost else None

    def send(
        self,
        peer: int,
        request: SliceRequest,
        x: torch.Tensor,
        positions: torch.Tensor,
        attn_out: torch.Tensor | None,
    ) -> SliceInFlight | None:
        """Post a slice to `peer`; None if the peer is lost (the engine runs the slice). The
        tensors must not change until `receive` has returned."""
        tensors = [x, positions] + ([] if attn_out is None else [attn_out])
        try:
            handle = self.links[peer].send_async(request, tensors)
        except Exception as exc:  # noqa: BLE001 - a peer gone: run the slice here
            self._drop(peer, f"send failed: {exc!r}")
            return None
        return SliceInFlight(peer, handle, request, x, time.perf_counter())

    def receive(self, flight: SliceInFlight) -> Slice | None:
        """The peer's (x, q, k, v) for `flight`, or None when the peer failed it (dropped; the
        engine runs the slice). A peer dropped since the send is not read: its link is closed."""
        if flight.peer in self.lost:
            return None
        link, timeout = self.links[flight.peer], self.reply_timeout_s
        try:
            link.wait(flight.handle, timeout)
            result, tensors = link.recv(None, timeout)
        except TimeoutError:
            self._drop(flight.peer, f"no reply in {timeout} s")
            return None
        except Exception as exc:  # noqa: BLE001 - closed, or malformed: the link is unusable
            self._drop(flight.peer, repr(exc))
            return None
        if (why := _wrong(result, flight, tensors, self.heads)) is not None:
            self._drop(flight.peer, why)
            return None
        self.counts.num_slices += 1
        self.counts.peer_s += time.perf_counter() - flight.sent_at
        x, q, k, v = tensors
        return x, q, k, v

    def close(self) -> None:
        for link in self.links:
            link.close()

    def _drop(self, peer: int, why: str) -> None:
        log.error("model peer lost; its slices run on the engine", peer=peer, why=why)
        self.lost.add(peer)
        self.counts.num_lost += 1
        self._close(self.links[peer])  # a late reply goes with it

    @staticmethod
    def _close(link: PeerLink) -> None:
        try:
            link.close()
        except Exception as exc:  # noqa: BLE001 - closing must not fail the step
            log.debug("closing a model peer's link failed", error=repr(exc))


def _wrong(
    result: Any, flight: SliceInFlight, tensors: list[torch.Tensor], heads: tuple[int, int, int]
) -> str | None:
    """Why a peer's reply cannot be used (None: it answers the slice sent, in the shapes and
    dtype of the engine's own slice)."""
    sent = flight.request
    if not isinstance(result, SliceResult):
        return f"answered a {type(result).__name__}"
    if (result.step, result.lane, result.layer) != (sent.step, sent.lane, sent.layer):
        return (f"reply for step {result.step} lane {result.lane} layer {result.layer}, expected "
                f"step {sent.step} lane {sent.lane} layer {sent.layer}")  # fmt: skip
    if result.error:
        return f"error: {result.error}"
    x = flight.x
    num_heads, num_kv_heads, head_dim = heads
    rows = x.shape[0]
    expected = [x.shape, (rows, num_heads, head_dim), *[(rows, num_kv_heads, head_dim)] * 2]
    got = [t.shape for t in tensors]
    if got != expected or any(t.dtype != x.dtype for t in tensors):
        return f"buffers {got} {[t.dtype for t in tensors]}, expected {expected} {x.dtype}"
    return None


__all__ = ["ModelPeers", "PeerCounts", "PeerLink", "SliceInFlight"]
