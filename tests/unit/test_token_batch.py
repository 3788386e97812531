"""The per-step front end: `TokenBatch` on the wire (services/engine/outbox.py packs an engine
step's outputs, the router's socket decodes it; a malformed one is dropped whole), one event-loop
wake-up per step (`StreamTable.deliver_many`), and outputs that arrive together leaving as one
(`coalesce`, `next_items`)."""

from __future__ import annotations

import asyncio
import threading

import msgspec
import pytest
import zmq

from common.engine.request import FinishReason, RequestOutput
from common.protocol import ServiceReply, TokenBatch, TokenLogprobs, TokenOutput
from common.token_stream import TokenStreamOrderer
from common.transport.zmq_sockets import TypedSocket
from services.engine.outbox import Outbox
from services.router.coalesce import coalesce
from services.router.streams import Stream, StreamTable, next_items

ROUTER_A, ROUTER_B = "tcp://a", "tcp://b"


def step_outbox() -> Outbox:
    """One engine step's outputs: plain tokens for two routers, one with logprobs, one error."""
    return Outbox(
        outputs=[
            (ROUTER_A, TokenOutput("r1", [11], "", 5, index=3)),
            (ROUTER_B, TokenOutput("r2", [12], "", 6, index=0)),
            (ROUTER_A, TokenOutput("r3", [13], "length", 7, index=9)),
            (ROUTER_A, TokenOutput("r4", [14], "", 8, index=1, logprobs=[TokenLogprobs(-0.5)])),
            (ROUTER_A, TokenOutput("r5", [], "error", 9, error="boom")),
        ]
    )


def test_a_step_is_one_batch_per_router_and_decodes_to_the_same_outputs() -> None:
    outbox = step_outbox()
    wire = outbox.wire_outputs()
    assert [(endpoint, type(m).__name__) for endpoint, m in wire] == [
        (ROUTER_A, "TokenBatch"), (ROUTER_B, "TokenBatch"),
        (ROUTER_A, "TokenOutput"), (ROUTER_A, "TokenOutput"),
    ]  # fmt: skip
    decoder = msgspec.msgpack.Decoder(ServiceReply)
    received = []
    for _, message in wire:
        decoded = decoder.decode(msgspec.msgpack.encode(message))
        received += decoded.outputs() if isinstance(decoded, TokenBatch) else [decoded]
    by_id = {o.req_id: o for o in received}
    assert sorted(by_id) == ["r1", "r2", "r3", "r4", "r5"]
    for _, sent in outbox.outputs:  # every field the router reads comes through unchanged
        assert by_id[sent.req_id] == sent


def test_a_malformed_batch_is_dropped_whole() -> None:
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("inproc://batch")
    push.connect("inproc://batch")
    replies: TypedSocket[ServiceReply] = TypedSocket(pull, ServiceReply)
    try:
        # Arrays of different lengths: a forgery or a bug, never half-applied.
        bad = ["token_batch", ["r1", "r2"], [1, 2], [0], ["", ""], [3, 3]]
        push.send(msgspec.msgpack.encode(bad))
        push.send(msgspec.msgpack.encode(TokenBatch(["r1"], [1], [0], [""], [3])))
        assert pull.poll(2000)
        first = replies.recv_nowait()
        if first is None:  # the bad one was read and dropped; the good one follows
            assert pull.poll(2000)
            first = replies.recv_nowait()
        assert first is not None and isinstance(first[1], TokenBatch)
        assert first[1].req_ids == ["r1"]
    finally:
        push.close(0)
        replies.close()
        ctx.term()
    with pytest.raises(msgspec.ValidationError, match="differ in length"):
        msgspec.msgpack.Decoder(ServiceReply).decode(msgspec.msgpack.encode(bad))


def test_batched_tokens_are_still_put_in_order_by_the_orderer() -> None:
    orderer = TokenStreamOrderer(expected_only=True)
    orderer.expect("r", 0)
    # The token engine's step (index 1) overtakes the prompt engine's first token (index 0).
    for out in TokenBatch(["r"], [22], [1], ["length"], [4]).outputs():
        orderer.push(out)
    assert not orderer.ready
    orderer.push(TokenOutput("r", [21], "", 4, index=0))
    assert [o.token_ids for o in orderer.ready] == [[21], [22]]


def out(req_id: str, token: int, text: str, n: int, reason: FinishReason | None = None):
    return RequestOutput(req_id, [token], text, reason, 4, n, logprobs=[TokenLogprobs(-n)])


def test_coalesce_joins_tokens_text_and_logprobs_and_keeps_the_finish() -> None:
    first = out("r", 1, "a", 1)
    first.prompt_logprobs = [TokenLogprobs(-9.0)]
    joined = coalesce([first, out("r", 2, "b", 2), out("r", 3, "c", 3, FinishReason.LENGTH)])
    assert joined.new_token_ids == [1, 2, 3] and joined.new_text == "abc"
    assert [lp.logprob for lp in joined.logprobs] == [-1, -2, -3]
    assert joined.prompt_logprobs == [TokenLogprobs(-9.0)]
    assert joined.finish_reason is FinishReason.LENGTH and joined.num_output_tokens == 3


def test_one_step_wakes_each_loop_once_and_what_waits_is_taken_together() -> None:
    async def run() -> None:
        table: StreamTable[Stream] = StreamTable()
        streams = {r: table.admit(r, 10, lambda r=r: Stream(req_id=r, num_prompt_tokens=10))
                   for r in ("a", "b")}  # fmt: skip
        loop = asyncio.get_running_loop()
        wakeups = 0
        original = loop.call_soon_threadsafe

        def counting(*args):  # type: ignore[no-untyped-def]
            nonlocal wakeups
            wakeups += 1
            return original(*args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        # Two steps from another thread, before the loop runs: a, b, a.
        step1 = [("a", out("a", 1, "x", 1), 1, False), ("b", out("b", 2, "y", 1), 1, False)]
        step2 = [("a", out("a", 3, "z", 2), 1, False), ("gone", out("gone", 4, "", 1), 1, False)]
        delivered: list[object] = []
        for step in (step1, step2):  # NOTE: joined at once: the loop runs only after both
            thread = threading.Thread(target=lambda s=step: delivered.extend(table.deliver_many(s)))
            thread.start()
            thread.join()
        assert wakeups == 2 and delivered[3] is None  # an unknown request's output is dropped
        assert table.num_pending_prompt_tokens == 0  # both first tokens are out
        items = await next_items(streams["a"].outputs)
        assert coalesce(items).new_token_ids == [1, 3]
        assert [o.new_token_ids for o in await next_items(streams["b"].outputs)] == [[2]]

    asyncio.run(run())
