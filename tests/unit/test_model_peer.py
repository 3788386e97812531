"""Lamina 4.3 across model replicas: a token engine's decode lanes rotate their layer slices over
model peers (services/engine/rotation.py, model_peer.py), lane j's slice k on replica
(j + k) mod R. The runner talks to in-process shards (tests/unit/test_decode_overlap.py) and to
peers in process or over a real UCX channel on 127.0.0.1; greedy tokens must equal the
single-process runner's, also when a peer dies, stays silent or answers wrongly mid-step (the
engine runs the slice itself and drops the peer), and when a dropped peer is linked again
between steps (`ModelPeers.relink`) and rejoins the rotation. The peer worker takes a restarted
engine's new link although the old one was never closed."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import pytest
import torch

from common.protocol import PeerLinkMessage, SliceRequest, SliceResult
from common.transport.ucx_channel import ChannelClosed, UcxTensorChannel
from common.transport.ucx_listener import UcxListener
from services.engine.model_peer import ModelPeer
from services.engine.model_peer_worker import serve_link
from services.engine.rotation import ModelPeers
from tests.unit.test_decode_overlap import NUM_STEPS, greedy_sharded
from tests.unit.test_decode_overlap import local as local  # noqa: F401 - fixtures
from tests.unit.test_decode_overlap import model as model  # noqa: F401
from tests.unit.test_decode_overlap import prompts as prompts  # noqa: F401


class InProcessPeerLink:
    """A model peer answering in process, as model_peer_worker.py does. `fault`, from the
    `fail_at`th slice on: "dead" (the channel closed), "silent" (no reply), "wrong_layer",
    "error" (the peer's error reply), "shape" (a q of the wrong shape)."""

    def __init__(self, peer: ModelPeer, fault: str = "", fail_at: int = -1) -> None:
        self.peer, self.fault, self.fail_at = peer, fault, fail_at
        self.replies: deque[tuple[SliceResult, list[torch.Tensor]]] = deque()
        self.slices: list[tuple[int, int, int]] = []  # (step, lane, layer) in arrival order
        self.closed = False

    def send_async(self, header: SliceRequest, tensors: list[torch.Tensor]) -> None:
        if self.closed:
            raise ChannelClosed("closed")
        self.slices.append((header.step, header.lane, header.layer))
        reply, out = self.peer.answer(header, [t.clone() for t in tensors])
        faulty = self.fault and len(self.slices) > self.fail_at
        if faulty and self.fault == "wrong_layer":
            reply.layer += 1
        elif faulty and self.fault == "error":
            reply, out = SliceResult(header.step, header.lane, header.layer, error="boom"), []
        elif faulty and self.fault == "shape":
            out[1] = out[1][:, :1]
        self.replies.append((reply, out))

    def wait(self, handle: Any, timeout: float | None = None) -> None:
        pass

    def recv(self, out: Any = None, timeout: float | None = None) -> tuple[SliceResult, list]:
        if self.fault in ("dead", "silent") and len(self.slices) > self.fail_at:
            raise ChannelClosed("peer gone") if self.fault == "dead" else TimeoutError()
        return self.replies.popleft()

    def close(self) -> None:
        self.closed = True


def heads_of(model) -> tuple[int, int, int]:
    mc = model.config
    return mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim


@pytest.mark.parametrize("lanes, num_peers, overlap", [(3, 1, False), (2, 1, False),
                         (4, 2, False), (3, 1, True)],
                         ids=["n3-R2", "n2-R2", "n4-R3", "n3-R2-overlap"])  # fmt: skip
def test_rotated_lanes_match_the_single_process_runner(
    model, prompts, local, lanes, num_peers, overlap
):
    links = [InProcessPeerLink(ModelPeer(model)) for _ in range(num_peers)]
    peers = ModelPeers(links, heads_of(model))
    got, logits, _ = greedy_sharded(model, prompts, overlap, lanes, model_peers=peers)
    assert got == local[0]
    for ours, theirs in zip(logits, local[1], strict=True):
        assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4)
    # Lane j's slice k ran on replica (j + k) mod R; replica 0 (the engine) ran the rest.
    num_layers, replicas = model.config.num_hidden_layers, 1 + num_peers
    for p, link in enumerate(links):
        expected = [(step, lane, layer) for step in range(NUM_STEPS)
                    for layer in range(num_layers) for lane in range(lanes)
                    if (lane + layer) % replicas == p + 1]  # fmt: skip
        assert sorted(link.slices) == sorted(expected) and expected
        assert not link.replies
    assert peers.counts.num_slices == sum(len(link.slices) for link in links)
    assert peers.counts.num_lost == 0


@pytest.mark.parametrize("fault", ["dead", "silent", "wrong_layer", "error", "shape"])
def test_a_faulty_peer_is_dropped_and_its_slices_run_on_the_engine(model, prompts, local, fault):
    link = InProcessPeerLink(ModelPeer(model), fault, fail_at=5)  # its 6th slice on
    peers = ModelPeers([link], heads_of(model), reply_timeout_s=0.1)
    got, _, shard_links = greedy_sharded(model, prompts, False, 3, model_peers=peers)
    assert got == local[0]  # no token changed, no request failed
    assert peers.counts.num_lost == 1 and link.closed and len(peers) == 0
    assert len(link.slices) == 6  # nothing was sent to it after its fault
    assert not any(shard.replies for shard in shard_links)


def test_a_shard_error_reads_the_peers_replies_in_flight(model, prompts):
    from tests.unit.test_decode_overlap import InProcessLink

    link = InProcessPeerLink(ModelPeer(model))
    shard_links: list[InProcessLink] = []
    with pytest.raises(RuntimeError, match="attention shard failed"):
        greedy_sharded(model, prompts, False, 3, fail_lane=2, links=shard_links,
                       model_peers=ModelPeers([link], heads_of(model)))  # fmt: skip
    assert not link.replies and not any(s.replies for s in shard_links)


@pytest.mark.parametrize(
    "request_, tensors, why",
    [
        (SliceRequest(0, 0, 99), [torch.zeros(1, 8), torch.zeros(1, dtype=torch.long)], "layer"),
        (SliceRequest(0, 0, 1), [torch.zeros(1, 8), torch.zeros(1, dtype=torch.long)], "buffers"),
        (SliceRequest(0, 0, 0), [torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)], "x "),
        (SliceRequest(0, 0, 0), ["x", torch.full((1,), 10**9, dtype=torch.long)], "positions"),
    ],
    ids=["layer", "no-attn-out", "hidden", "position"],
)  # fmt: skip
def test_a_wrong_slice_request_is_answered_with_an_error(model, request_, tensors, why):
    peer = ModelPeer(model)
    if isinstance(tensors[0], str):
        tensors[0] = torch.zeros(1, model.config.hidden_size)
    reply, out = peer.answer(request_, tensors)
    assert why in reply.error and out == [] and peer.num_slices == 0
    assert (reply.step, reply.lane, reply.layer) == (request_.step, request_.lane, request_.layer)


class StopAfter:
    """`serve_link`'s `running`: true for the first `num_slices` slices the peer answered."""

    def __init__(self, peer: ModelPeer, num_slices: int) -> None:
        self.peer, self.num_slices = peer, num_slices
        self.stopped = threading.Event()

    def __call__(self) -> bool:
        return not self.stopped.is_set() and self.peer.num_slices < self.num_slices


@pytest.mark.parametrize("dies_after", [None, 5], ids=["live", "peer-dies"])
def test_rotated_lanes_over_a_real_ucx_peer(model, prompts, local, dies_after):
    """n = 3 lanes on R = 2 replicas, the peer served by model_peer_worker's loop over UCX; with
    `dies_after`, the peer stops after that many slices and closes its end (in step 0)."""
    listener = UcxListener(PeerLinkMessage, "127.0.0.1", b"k")
    served = ModelPeer(model)
    running = StopAfter(served, 10**9 if dies_after is None else dies_after)

    def serve() -> None:
        link = listener.accept(timeout=10)
        serve_link(served, link, running)
        link.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    link = UcxTensorChannel.connect(listener.address, PeerLinkMessage, key=b"k")
    peers = ModelPeers([link], heads_of(model), reply_timeout_s=2 if dies_after else 10)
    try:
        got, _, _ = greedy_sharded(model, prompts, False, 3, model_peers=peers)
    finally:
        running.stopped.set()
        thread.join(timeout=5)
        link.close()
    assert got == local[0]
    num_layers = model.config.num_hidden_layers
    per_step = sum((lane + layer) % 2 for layer in range(num_layers) for lane in range(3))
    if dies_after is None:
        assert served.num_slices == peers.counts.num_slices == NUM_STEPS * per_step
        assert peers.counts.num_lost == 0
    else:
        assert served.num_slices == peers.counts.num_slices == dies_after
        assert peers.counts.num_lost == 1 and len(peers) == 0


def test_a_lost_peer_rejoins_the_rotation_when_relinked(model, prompts, local):
    """A peer dies in step 0 (dropped); before step 1 its address does not answer a new link
    (left out); before step 2 it is back (a new link: the rotation grows again). Tokens stay
    the single-process runner's throughout."""
    first = InProcessPeerLink(ModelPeer(model), "dead", fail_at=5)
    back = InProcessPeerLink(ModelPeer(model))
    peers = ModelPeers([first], heads_of(model), reply_timeout_s=0.1, addresses=["peer-a"])

    def connect(address: str) -> InProcessPeerLink:
        if not joined_at:
            raise ChannelClosed("no answer yet")
        return back

    joined_at: list[int] = []

    def between_steps(step: int) -> None:
        if step == 1:
            assert peers.relink(["peer-a"], connect) == [] and len(peers) == 0
        if step == 2:
            joined_at.append(step)
            assert peers.relink(["peer-a"], connect) == ["peer-a"] and len(peers) == 1

    got, _, _ = greedy_sharded(model, prompts, False, 3, model_peers=peers,
                               between_steps=between_steps)  # fmt: skip
    assert got == local[0]
    assert peers.counts.num_lost == 1 and peers.counts.num_joined == 1 and first.closed
    num_layers = model.config.num_hidden_layers
    expected = [(step, lane, layer) for step in range(2, NUM_STEPS) for layer in range(num_layers)
                for lane in range(3) if (lane + layer) % 2 == 1]  # fmt: skip
    assert sorted(back.slices) == sorted(expected)  # every slice of replica 1 from step 2 on
    assert 0 < peers.counts.num_slices - len(expected) <= 5  # the first peer's, before it died


def test_relink_keeps_listed_links_and_closes_the_rest(model):
    a, b = InProcessPeerLink(ModelPeer(model)), InProcessPeerLink(ModelPeer(model))
    c = InProcessPeerLink(ModelPeer(model))
    peers = ModelPeers([a, b], heads_of(model), addresses=["a", "b"])
    assert peers.relink(["c", "a", "c"], lambda address: c) == ["c"]  # listed twice: once
    assert peers.links == [c, a] and peers.addresses == ["c", "a"]
    assert b.closed and not a.closed and not c.closed
    assert peers.relink([], lambda address: c) == [] and a.closed and c.closed and not peers
    with pytest.raises(ValueError, match="addresses"):
        ModelPeers([a], heads_of(model), addresses=["a", "b"])


def test_a_restarted_engine_gets_its_peer_back_over_ucx(model, prompts, local):
    """The engine that linked the peer dies without closing its link (the peer's side stays
    open and silent); the restarted engine's new link is accepted and the old one dropped. A
    hello without the mesh's key is refused and does not cost the live link; a link that sends
    a message of another kind gets no answer and costs the peer nothing."""
    from common.roles import Role
    from common.worker_config import WorkerConfig
    from services.engine.model_peer_worker import ModelPeerWorker

    key = b"k" * 16
    cfg = WorkerConfig(service_id="peer-0", role=Role.MODEL_PEER, model_path="", mesh_key=key.hex(),
                       ready_endpoint="")  # fmt: skip
    worker = ModelPeerWorker(cfg, model)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    address = worker.ready().link_address

    def connect(address: str, key: bytes = key) -> UcxTensorChannel:
        return UcxTensorChannel.connect(address, PeerLinkMessage, key=key, timeout=5)

    def one_slice(link: UcxTensorChannel) -> SliceResult:
        x, positions = torch.zeros(1, model.config.hidden_size), torch.zeros(1, dtype=torch.long)
        link.send(SliceRequest(0, 0, 0), [x, positions])
        reply, _ = link.recv(timeout=5)
        return reply

    old = connect(address)
    try:
        assert not one_slice(old).error
        with pytest.raises(ChannelClosed):
            UcxTensorChannel.connect(address, PeerLinkMessage, key=b"x" * 16, timeout=1)
        assert not one_slice(old).error  # the bad hello did not cost the link
        # A process with the key that sends what no peer takes (a shard's message) is refused
        # for no step (a closed link alone would leave it waiting: over TCP the far end only
        # sees silence), and the peer serves the next link (the restarted engine's, below).
        from common.protocol import AttendBatch, ShardLinkMessage

        rogue = UcxTensorChannel.connect(address, ShardLinkMessage | PeerLinkMessage, key=key,
                                         timeout=5)  # fmt: skip
        rogue.send(AttendBatch(0, 0), [torch.zeros(1)])
        refusal, _ = rogue.recv(timeout=2)
        assert isinstance(refusal, SliceResult) and refusal.step == -1
        assert "message not received" in refusal.error
        rogue.close()
        # `old` is abandoned here, open: its engine "died". The restarted engine links.
        peers = ModelPeers([], heads_of(model), reply_timeout_s=10)
        assert peers.relink([address], connect) == [address]
        got, _, _ = greedy_sharded(model, prompts, False, 3, model_peers=peers)
        assert got == local[0]
        assert peers.counts.num_lost == 0 and peers.counts.num_slices > 0
        assert worker.peer.num_slices == 2 + peers.counts.num_slices
    finally:
        worker.running = False
        thread.join(timeout=5)
        old.close()
        if "peers" in locals():
            peers.close()
    assert not thread.is_alive()
