"""`StreamInterval` (services/router/streams.py): a stream's tokens held back and handed on
together, one wake-up (one SSE chunk) per `tokens` tokens. The first token goes at once, a finish
or an error flushes what is held, a released (aborted, closed) stream drops it; and through a real
`InProcessEngineClient` the tokens are the engine's, greedy, in fewer outputs. The mesh router
decodes the token messages that arrive together at once, to the same text."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch

from common.engine.core import LLMEngine
from common.engine.request import FinishReason, OutputText, RequestOutput
from common.protocol import TokenOutput
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer
from services.router.engine_client import InProcessEngineClient
from services.router.streams import Stream, StreamInterval, StreamTable, next_items
from services.router.token_text import StreamedText, join_token_outputs


def out(token: int, finish: FinishReason | None = None) -> RequestOutput:
    return RequestOutput("a", [token], f"t{token}", finish, 4, token)


def table_with(interval: StreamInterval) -> tuple[StreamTable[Stream], Stream]:
    table: StreamTable[Stream] = StreamTable(interval=interval)
    return table, table.admit("a", 4, lambda: Stream(req_id="a", num_prompt_tokens=4))


def step(table: StreamTable[Stream], output: RequestOutput) -> None:
    """One engine step's delivery, from another thread as the engine loop does it."""
    item = ("a", output, len(output.new_token_ids), output.finished)
    thread = threading.Thread(target=table.deliver_many, args=([item],))
    thread.start()
    thread.join()


async def drained(stream: Stream) -> list[list[int]]:
    """The token ids of each output waiting in the stream's queue."""
    await asyncio.sleep(0)  # the loop runs the deliveries' callbacks
    if stream.outputs.empty():
        return []
    return [o.new_token_ids for o in await next_items(stream.outputs)]


def test_first_token_at_once_then_every_interval_and_finish_flushes() -> None:
    async def run() -> None:
        table, stream = table_with(StreamInterval(tokens=3))
        step(table, out(1))
        assert await drained(stream) == [[1]]  # TTFT is never delayed
        assert table.num_pending_prompt_tokens == 0
        step(table, out(2))
        step(table, out(3))
        assert await drained(stream) == []  # held: 2 of 3 tokens
        step(table, out(4))
        assert await drained(stream) == [[2], [3], [4]]  # one wake-up, in order
        step(table, out(5))
        step(table, out(6, FinishReason.LENGTH))
        assert await drained(stream) == [[5], [6]]  # the finish goes at once with what is held

    asyncio.run(run())


def test_an_error_or_abort_never_strands_held_tokens() -> None:
    async def run() -> None:
        table, stream = table_with(StreamInterval(tokens=8))
        step(table, out(1))
        step(table, out(2))
        failure = RuntimeError("engine lost")
        assert table.deliver("a", failure, has_tokens=False) is stream  # an error: at once
        await asyncio.sleep(0)
        assert [stream.outputs.get_nowait() for _ in range(3)][1:] == [out(2), failure]
        step(table, out(3))  # held again
        assert table.release("a") is stream  # aborted or closed: nobody listens
        step(table, out(4, FinishReason.LENGTH))  # a late finish of a released stream: dropped
        assert await drained(stream) == [] and len(table) == 0

    asyncio.run(run())


def test_default_sends_every_output_and_the_time_cap_sends_held_ones() -> None:
    async def run() -> None:
        table, stream = table_with(StreamInterval())
        for token in (1, 2, 3):
            step(table, out(token))
            assert await drained(stream) == [[token]]  # tokens=1: today's behaviour

    asyncio.run(run())
    cap = StreamInterval(tokens=100, seconds=0.05)
    assert not cap.due(held_tokens=5, held_since=10.0, now=10.01)
    assert cap.due(held_tokens=5, held_since=10.0, now=10.06)
    assert StreamInterval(tokens=4).due(held_tokens=4, held_since=10.0, now=10.0)
    with pytest.raises(ValueError):
        StreamInterval(tokens=0)


def test_a_stream_held_to_its_end_wakes_for_its_first_token_and_its_last() -> None:
    """`hold_to_end` (a plain response): whatever the interval, the first token goes at once
    (admission, TTFT), every later one waits for the request's end or an error, in order, and
    no window timer runs for it."""

    async def run() -> None:
        table: StreamTable[Stream] = StreamTable(interval=StreamInterval(tokens=2, seconds=0.01))
        stream = table.admit("a", 4, lambda: Stream(req_id="a", num_prompt_tokens=4,
                                                     hold_to_end=True))  # fmt: skip
        step(table, out(1))
        assert await drained(stream) == [[1]] and table.num_pending_prompt_tokens == 0
        for token in (2, 3, 4):
            step(table, out(token))
        await asyncio.sleep(0.05)  # past the window: still held
        assert await drained(stream) == []
        step(table, out(5, FinishReason.LENGTH))
        assert await drained(stream) == [[2], [3], [4], [5]]
        loop = asyncio.get_running_loop()
        assert not [h for h in loop._scheduled if not h.cancelled()]  # type: ignore[attr-defined]

        table.admit("b", 4, lambda: Stream(req_id="b", num_prompt_tokens=4, hold_to_end=True))
        failure = RuntimeError("engine lost")
        for item in (out(1), out(2)):
            table.deliver_many([("b", item, 1, False)])
        table.deliver("b", failure, has_tokens=False)  # an error: what is held goes before it
        held = table.get("b")
        assert held is not None
        await asyncio.sleep(0)
        assert [held.outputs.get_nowait() for _ in range(3)] == [out(1), out(2), failure]

    asyncio.run(run())


def test_in_process_client_holds_a_plain_requests_tokens_to_its_end(tiny_model_path: Path) -> None:
    engine = LLMEngine.from_path(tiny_model_path, num_blocks=64)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = engine.generate([[5, 6, 7]], params)  # before the client's thread owns it
    client = InProcessEngineClient(engine, num_threads=1)

    async def run() -> list[list[int]]:
        outputs = client.generate("r", [5, 6, 7], params, hold_to_end=True)
        return [o.new_token_ids async for o in outputs]

    try:
        outputs = asyncio.run(run())
    finally:
        client.shutdown()
    assert [t for o in outputs for t in o] == expected[0]  # greedy: the engine's own tokens
    assert len(outputs) <= 2 and len(outputs[-1]) >= 9  # two wake-ups: the first token, the rest


class FirstTokenGate:
    """The engine, whose second step waits until the reader has the first token: the first
    output is then that token alone however late the event loop runs (a loop slower than the
    engine thread would otherwise get the first tokens together, which is right, but not what
    this test can tell from holding the first token back)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.first_read = threading.Event()
        self.steps = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.engine, name)

    def step(self) -> list[RequestOutput]:
        if self.steps == 1:
            assert self.first_read.wait(30), "the first token never reached the reader"
        self.steps += 1
        return self.engine.step()


def test_in_process_client_streams_the_engines_tokens_in_intervals(
    tiny_model_path: Path,
) -> None:
    engine = LLMEngine.from_path(tiny_model_path, num_blocks=64)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = engine.generate([[5, 6, 7]], params)  # before the client's thread owns it
    gate = FirstTokenGate(engine)
    client = InProcessEngineClient(gate, num_threads=1)  # type: ignore[arg-type]
    client.streams.interval = StreamInterval(tokens=4)

    async def run() -> list[list[int]]:
        outputs = []
        async for o in client.generate("r", [5, 6, 7], params):
            outputs.append(o.new_token_ids)
            gate.first_read.set()
        return outputs

    try:
        outputs = asyncio.run(run())
    finally:
        client.shutdown()
    assert [t for o in outputs for t in o] == expected[0]  # greedy: the engine's own tokens
    # 1 at once, then >= 4 per output but the last: fewer outputs than tokens.
    assert len(outputs[0]) == 1 and all(len(o) >= 4 for o in outputs[1:-1])
    assert len(outputs) <= 4


def test_held_mesh_messages_decode_as_one_with_the_same_text(tiny_model_path: Path) -> None:
    """The mesh router joins token messages that arrived together (`join_token_outputs`) and
    decodes them at once: the same text as one message per step, in one output."""
    tokenizer = Tokenizer(tiny_model_path)
    ids = torch.randint(8, 500, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    msgs = [TokenOutput("w", [t], "length" if i == len(ids) - 1 else "", 4, index=i)
            for i, t in enumerate(ids)]  # fmt: skip
    joined = join_token_outputs([*msgs[:10], RuntimeError("lost"), *msgs[10:]])
    assert [len(m.token_ids) for m in joined if isinstance(m, TokenOutput)] == [10, 30]
    assert joined[-1].finish_reason == "length" and joined[-1].index == 10
    assert join_token_outputs([msgs[0], msgs[2]]) == [msgs[0], msgs[2]]  # not contiguous

    def text_of(messages: list[TokenOutput], stop: list[str]) -> tuple[str, list[int]]:
        streamed = StreamedText("r", 4, OutputText(stop), tokenizer)
        outs = [o for m in messages for o in streamed.on_tokens(m)]
        assert outs[-1].finish_reason == "length"
        return "".join(o.new_text for o in outs), [t for o in outs for t in o.new_token_ids]

    one_by_one = text_of(msgs, [])
    assert text_of(join_token_outputs(msgs), []) == one_by_one == (tokenizer.decode(ids), ids)
    # With stop strings tokens still go one at a time, so the stop ends the request exactly.
    assert text_of(join_token_outputs(msgs), ["\x00never"]) == one_by_one


def test_app_args_refuse_an_interval_below_one_at_deploy_time() -> None:
    from pydantic import ValidationError

    from services.app import AppArgs

    assert AppArgs.model_validate({"stream_interval": 4}).stream_interval == 4
    for bad in ({"stream_interval": 0}, {"stream_interval_s": -1.0}):
        with pytest.raises(ValidationError):
            AppArgs.model_validate(bad)


def test_the_window_timer_sends_what_a_stalled_engine_left_held() -> None:
    async def run() -> None:
        table, stream = table_with(StreamInterval(tokens=100, seconds=0.05))
        step(table, out(1))
        step(table, out(2))  # held; the engine then stalls: no more outputs
        assert await drained(stream) == [[1]]
        await asyncio.sleep(0.2)  # the window passes: the timer sends it
        assert await drained(stream) == [[2]]
        table.release("a")
        await asyncio.sleep(0.1)  # the released stream's timer stops (nothing left scheduled)
        loop = asyncio.get_running_loop()
        assert not [h for h in loop._scheduled if not h.cancelled()]  # type: ignore[attr-defined]

    asyncio.run(run())
