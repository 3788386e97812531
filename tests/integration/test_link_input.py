"""What a shard and a model peer take on their UCX link. Given a message they cannot receive
(from a member of the mesh gone wrong: its hello is signed, its envelope describes other tensors
than the message carries), they answer it for no step (their token engine drops the link at once
instead of waiting out its reply timeout: a closed endpoint tells it nothing), close that link and
serve the next one; the error used to end the shard's serving loop. And a shard serves the newest
link, as a model peer does, so that a token engine that relinks is not left waiting."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import msgspec
import pytest
import torch

from common.attention import select_backend
from common.protocol import (
    AttendBatch,
    AttendResult,
    KvPages,
    KvReadyQuery,
    PeerLinkMessage,
    ShardIngress,
    ShardLinkMessage,
    SliceRequest,
    SliceResult,
)
from common.transport.kv_links import POLL_S as KV_POLL_S
from common.transport.kv_links import KvReceiver
from common.transport.tensor_frames import EnvelopeCodec
from common.transport.ucx_channel import ChannelClosed, UcxTensorChannel
from common.transport.ucx_listener import UcxListener
from services.engine.model_peer_worker import serve_link
from services.shard import shard as shard_module
from services.shard.kv_news import KvNews
from services.shard.shard import AttentionShard, ShardSpec
from services.shard.step_gate import StepGate
from services.shard.telemetry import ShardTelemetry
from services.shard.worker import POLL_S, ShardWorker
from tests.integration.test_transport import send_rogue_hellos

KEY = b"mesh key"

# What the lying envelope claims the message carries (the message itself carries no tensor):
# more than any machine can allocate, or more than an inline message can hold.
CLAIMS = {
    "unallocatable": [torch.empty(1 << 42, device="meta")],  # 16 TiB of float32
    "overruns_the_message": [torch.empty(3, 1 << 18, device="meta")],  # 3 MiB, nothing sent
}


class LyingCodec(EnvelopeCodec[Any]):
    """Describes `claimed` in every envelope it encodes, whatever the message carries."""

    def __init__(self, header_type: Any, claimed: Sequence[torch.Tensor]) -> None:
        super().__init__(header_type)
        self.claimed = list(claimed)

    def encode(self, header: Any, tensors: Sequence[torch.Tensor]) -> bytes:
        return super().encode(header, self.claimed)


def lying_link(address: str, header_type: Any, claim: str) -> UcxTensorChannel[Any]:
    link = UcxTensorChannel.connect(address, header_type, key=KEY)
    link._codec = LyingCodec(header_type, CLAIMS[claim])
    return link


def shard_loop_only(listener: UcxListener) -> ShardWorker:
    """A `ShardWorker`'s link loop (`serve_links`) with a real shard behind it, without its
    other sockets."""
    spec = ShardSpec(num_layers=2, head_start=0, head_end=1, num_queries_per_kv=2, head_dim=16,
                     num_blocks=4, block_size=16, dtype=torch.float32, scale=1.0)  # fmt: skip
    worker = ShardWorker.__new__(ShardWorker)
    worker.listener = listener
    worker.shard = AttentionShard("s0", spec, select_backend("auto"))
    worker.telemetry = ShardTelemetry("s0", spec.num_layers)
    worker.gate, worker.news = StepGate(), KvNews()
    worker._prev_errors, worker._prev_s = {}, {}
    worker.running = True
    return worker


@contextmanager
def serving_shard() -> Iterator[str]:
    """A shard's link loop on its own thread, as its main thread runs it; yields its address."""
    listener = UcxListener(ShardLinkMessage, "127.0.0.1", KEY)
    worker = shard_loop_only(listener)
    thread = threading.Thread(target=worker.serve_links, daemon=True)
    thread.start()
    try:
        yield listener.address
    finally:
        worker.running = False  # ShardWorker.close
        thread.join(timeout=10)
        listener.close()
    assert not thread.is_alive()


def answers(link: UcxTensorChannel[Any], step: int, timeout: float = 10) -> bool:
    """Whether the shard behind `link` answers a `KvReadyQuery` for `step`."""
    link.send(KvReadyQuery(step=step))
    reply, tensors = link.recv(timeout=timeout)
    return (
        isinstance(reply, AttendResult)
        and (reply.step, reply.layer) == (step, -1)
        and (not reply.error and tensors == [])
    )


@pytest.mark.parametrize("claim", sorted(CLAIMS))
def test_a_shard_closes_a_link_it_cannot_receive_from_and_serves_the_next(claim: str) -> None:
    with serving_shard() as address:
        hostile = lying_link(address, ShardLinkMessage, claim)
        hostile.send(AttendBatch(0, 0, req_ids=["r"], context_lens=[1]))
        refusal, tensors = hostile.recv(timeout=10)
        assert isinstance(refusal, AttendResult) and (refusal.step, refusal.layer) == (-1, -1)
        assert "message not received" in refusal.error and tensors == []
        hostile.close()
        link = UcxTensorChannel.connect(address, ShardLinkMessage, key=KEY)
        assert answers(link, 7)
        link.close()


def test_the_engine_receives_a_refusal_as_a_reply_that_does_not_fit() -> None:
    """What the token engine does with a refusal: it receives each reply into its output rows, and
    a refusal carries none, so the receive raises the ValueError that `collect_layer` turns into
    `ShardLinkFault` at once (tests/unit/test_shard_replies.py, "misfit"): the group is relinked."""
    with serving_shard() as address:
        engine = lying_link(address, ShardLinkMessage, "unallocatable")
        engine.send(AttendBatch(0, 0, req_ids=["r"], context_lens=[1]))
        with pytest.raises(ValueError, match="0 tensors, 1 receive buffers"):
            engine.recv([torch.empty(1, 2, 16)], timeout=10)
        engine.close()


def test_a_newer_link_takes_over_an_idle_one_and_a_bad_hello_does_not() -> None:
    """A token engine that gave its links up (`ShardLinkFault`) links again while its old link
    is still open on its side (closing an endpoint tells the shard nothing): the shard serves
    the newer link within a poll instead of leaving the engine's connect to time out. A hello
    without the mesh's key costs the idle link nothing."""
    with serving_shard() as address:
        old = UcxTensorChannel.connect(address, ShardLinkMessage, key=KEY)
        assert answers(old, 1)
        send_rogue_hellos(address)
        time.sleep(3 * POLL_S)  # idle polls with the rogue hellos pending
        assert answers(old, 2)
        new = UcxTensorChannel.connect(address, ShardLinkMessage, key=KEY, timeout=5)
        assert answers(new, 3)
        old.close()
        new.close()


@pytest.mark.parametrize("claim", sorted(CLAIMS))
def test_a_kv_receiver_drops_a_link_it_cannot_receive_from_and_serves_the_others(
    claim: str,
) -> None:
    """One prompt engine's link gone wrong must not stop a shard's or token engine's KV
    receiver (its thread serves every prompt engine's link): that link is dropped, another
    link's pages land."""
    landed: list[tuple[str, list[torch.Tensor]]] = []
    arrived = threading.Event()

    def deliver(header: Any, tensors: list[torch.Tensor]) -> None:
        landed.append((header.req_id, tensors))
        arrived.set()

    receiver = KvReceiver("127.0.0.1", KEY, deliver)
    try:
        hostile = lying_link(receiver.address, ShardIngress, claim)
        good = UcxTensorChannel.connect(receiver.address, ShardIngress, key=KEY)
        k = torch.arange(2 * 3 * 1 * 4, dtype=torch.float32).view(2, 3, 1, 4)
        pages = KvPages("r", 0, 2, 3, 0, 1, total_layers=2)
        hostile.send(msgspec.structs.replace(pages, req_id="evil"), [k, k])
        time.sleep(3 * KV_POLL_S)  # the receiver takes the lie first
        good.send(pages, [k, -k])
        assert arrived.wait(timeout=10)
        [(req_id, (got_k, got_v))] = landed
        assert req_id == "r" and torch.equal(got_k, k) and torch.equal(got_v, -k)
        hostile.close()
        good.close()
    finally:
        receiver.close()


class NeverAsked:
    """A model peer that a message which never arrived must not reach."""

    def answer(self, *args: Any) -> Any:
        raise AssertionError("answered a message it could not have received")


@pytest.mark.parametrize("claim", sorted(CLAIMS))
def test_a_model_peer_closes_a_link_it_cannot_receive_from(claim: str) -> None:
    listener = UcxListener(PeerLinkMessage, "127.0.0.1", KEY)
    ended: list[bool] = []

    def serve() -> None:
        link = listener.accept(timeout=10)
        ended.append(serve_link(NeverAsked(), link))  # type: ignore[arg-type]
        link.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        hostile = lying_link(listener.address, PeerLinkMessage, claim)
        hostile.send(SliceRequest(0, 0, 0))
        refusal, tensors = hostile.recv(timeout=10)
        assert isinstance(refusal, SliceResult) and refusal.step == -1 and tensors == []
        assert "message not received" in refusal.error
        hostile.close()
        thread.join(timeout=10)
    finally:
        listener.close()
    assert ended == [False]  # the link is over; the worker accepts the next


class DeadPeerLink:
    """A link whose token engine died after its message came: each reply raises ChannelClosed
    (a stand-in for that timing window, which real processes hit only by chance)."""

    def __init__(self, messages: list[tuple[Any, list[torch.Tensor]]]) -> None:
        self.messages = messages
        self.closed = False

    def has_message(self) -> bool:
        return bool(self.messages)

    def recv(self, out: Any = None, timeout: float | None = None) -> tuple[Any, list]:
        return self.messages.pop(0)

    def send(self, header: Any, tensors: Any = (), timeout: float | None = None) -> None:
        raise ChannelClosed("UCX peer gone: Connection reset by remote peer")

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("asked", ["kv_news", "attention", "failed_attention"])
def test_a_shard_whose_engine_dies_before_its_reply_ends_that_link_only(
    asked: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reply to a token engine that died after asking cannot be sent: that link is over
    (its requests freed), and the shard's loop goes on to the next link instead of ending."""
    monkeypatch.setattr(shard_module, "KV_WAIT_S", 0.0)  # KV that never comes fails at once
    listener = UcxListener(ShardLinkMessage, "127.0.0.1", KEY)
    worker = shard_loop_only(listener)
    q, kv = torch.zeros(1, 2, 16), torch.zeros(1, 1, 16)
    message = {
        "kv_news": (KvReadyQuery(step=1), []),
        # A request the shard holds no KV for: answered with its row failed.
        "attention": (AttendBatch(1, 0, req_ids=["r"], context_lens=[1]), [q, kv, kv]),
        # Buffers of the wrong shapes: answered with an error.
        "failed_attention": (AttendBatch(1, 0, req_ids=["r"], context_lens=[1]), [kv, kv, q]),
    }[asked]
    dead = DeadPeerLink([message])
    try:
        assert worker._serve(dead) is None  # type: ignore[arg-type]
        assert dead.closed and worker.running
    finally:
        listener.close()
