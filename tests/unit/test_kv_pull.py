"""Shards pulling KV from a prompt engine's hold (`kv_transfer: pull`), over real ZeroMQ sockets:
a pull lands only between decode steps; a hold that misses or is dead makes the KV lost (the
token engine then ends the request retryably), never a hang; a traced pull's `kv.pull` span says
which (the landed case across a real mesh: tests/integration/test_tracing.py)."""

from __future__ import annotations

import queue
import threading

import pytest
import torch
from opentelemetry.trace import StatusCode

from common.kv_hold import KvHold
from common.protocol import KvAnnounce, KvPages
from common.telemetry import inject_context
from common.telemetry.spans import tracer
from common.transport.zmq_auth import CurveKeys
from services.engine.kv_hold_server import KvHoldServer
from services.shard.kv_puller import KvPuller
from services.shard.step_gate import StepGate

AUTH = CurveKeys.from_mesh_key("ab" * 32)
LAYERS, TOKENS = 4, 6


@pytest.fixture
def server():
    hold = KvHoldServer(KvHold(max_bytes=1 << 20), "127.0.0.1", AUTH)
    yield hold
    hold.close()


def hold_request(hold: KvHold, req_id: str) -> None:
    for layer in range(LAYERS):  # layer-wise, as a long prompt's prefill puts it
        pages = KvPages(req_id, layer, 1, TOKENS, 0, 2, LAYERS, reserve_tokens=TOKENS + 8)
        k = torch.full((1, TOKENS, 2, 8), float(layer))
        assert hold.put(pages, k, k + 0.5)


class Landings:
    def __init__(self) -> None:
        self.landed: queue.SimpleQueue[tuple[KvPages, list[torch.Tensor]]] = queue.SimpleQueue()
        self.lost: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()

    def puller(self, gate: StepGate, timeout_s: float = 5.0, land=None) -> KvPuller:
        return KvPuller(gate, land or (lambda p, t: self.landed.put((p, t))),
                        lambda r, why: self.lost.put((r, why)), AUTH, timeout_s,
                        shard_id="shard-7")  # fmt: skip


def test_a_pull_lands_the_whole_request_between_steps_only(server):
    hold_request(server.hold, "a")
    gate, landings = StepGate(), Landings()
    puller = landings.puller(gate)
    try:
        gate.start_step()  # a decode step is in progress: the landing waits for its end
        puller.announce(KvAnnounce("a", server.endpoint, 0, 2))
        with pytest.raises(queue.Empty):
            landings.landed.get(timeout=0.5)
        gate.end_step()
        pages, (k, v) = landings.landed.get(timeout=5)
        assert (pages.req_id, pages.layer_start, pages.num_layers) == ("a", 0, LAYERS)
        assert pages.reserve_tokens == TOKENS + 8
        assert k[:, 0, 0, 0].tolist() == [0.0, 1.0, 2.0, 3.0] and torch.equal(v, k + 0.5)
        assert len(server.hold) == 0  # pulled: the prompt engine's copy is gone
    finally:
        puller.close()


def test_a_step_arriving_during_a_landing_waits_for_it_alone():
    gate = StepGate()
    entered, release = threading.Event(), threading.Event()

    def land() -> None:
        with gate.free_period():
            entered.set()
            release.wait(5)

    lander = threading.Thread(target=land)
    lander.start()
    assert entered.wait(5)
    stepper = threading.Thread(target=gate.start_step)
    stepper.start()
    stepper.join(0.3)
    assert stepper.is_alive()  # layer 0 waits for the landing in progress
    release.set()
    stepper.join(5)
    lander.join(5)
    assert not stepper.is_alive()


def test_a_miss_makes_the_kv_lost(server):
    gate, landings = StepGate(), Landings()
    puller = landings.puller(gate)
    try:
        puller.announce(KvAnnounce("gone", server.endpoint, 0, 2))
        req_id, why = landings.lost.get(timeout=5)
        assert req_id == "gone" and "not held" in why
    finally:
        puller.close()


def test_a_dead_prompt_engine_makes_the_kv_lost_after_the_timeout(server):
    """Its hold never answers: lost after `timeout_s`, and the next pull from a live hold works
    (the dead one's socket is dropped)."""
    hold_request(server.hold, "b")
    dead = KvHoldServer(KvHold(max_bytes=1 << 20), "127.0.0.1", AUTH)
    hold_request(dead.hold, "a")
    dead.close()  # its process died after announcing
    gate, landings = StepGate(), Landings()
    puller = landings.puller(gate, timeout_s=0.5)
    try:
        puller.announce(KvAnnounce("a", dead.endpoint, 0, 2))
        puller.announce(KvAnnounce("b", server.endpoint, 0, 2))
        req_id, why = landings.lost.get(timeout=5)
        assert req_id == "a" and "did not answer" in why
        assert landings.landed.get(timeout=5)[0].req_id == "b"
    finally:
        puller.close()


def test_a_traced_pull_that_fails_ends_its_span_failed_with_why(server, spans):
    """A miss, and a landing that raises: each request's `kv.pull` (a child of its context) ends
    ERROR with the reason; the one that reached its hold carries the ask and answer events."""
    with tracer().start_as_current_span("router.request") as request:
        traceparent = inject_context()
    hold_request(server.hold, "bad")

    def land(pages: KvPages, tensors: list[torch.Tensor]) -> None:
        raise ValueError("wrong heads")

    gate, landings = StepGate(), Landings()
    puller = landings.puller(gate, land=land)
    try:
        puller.announce(KvAnnounce("gone", server.endpoint, 0, 2, traceparent=traceparent))
        puller.announce(KvAnnounce("bad", server.endpoint, 0, 2, traceparent=traceparent))
        puller.announce(KvAnnounce("untraced", server.endpoint, 0, 2))
        lost = dict(landings.lost.get(timeout=5) for _ in range(3))
    finally:
        puller.close()
    pulls = [s for s in spans.get_finished_spans() if s.name == "kv.pull"]
    assert len(pulls) == 2  # the untraced pull records nothing
    for span, why in zip(pulls, (lost["gone"], lost["bad"]), strict=True):
        assert span.parent is not None and span.parent.span_id == request.get_span_context().span_id
        assert span.status.status_code is StatusCode.ERROR and span.status.description == why
        assert span.attributes is not None and span.attributes["phasemesh.shard"] == "shard-7"
    assert "not held" in lost["gone"] and "wrong heads" in lost["bad"]
    assert [e.name for e in pulls[0].events] == ["kv.pull.ask"]
    assert [e.name for e in pulls[1].events] == ["kv.pull.ask", "kv.pull.answer"]
    assert pulls[1].events[1].attributes == {
        "phasemesh.kv.bytes": 2 * LAYERS * TOKENS * 2 * 8 * 4,
        "phasemesh.kv.num_layers": LAYERS,
    }
