"""The in-process engine's text is made on the router's loop (`TokenText`) unless a stop string
needs it in the engine: the same text as the engine's own, token by token, streamed or held to
the end, and no decode on the engine thread for it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.engine.core import LLMEngine
from common.engine.request import FinishReason
from common.sampling_params import SamplingParams
from services.router.engine_client import ENGINE_THREAD_NAME, InProcessEngineClient

PROMPTS = [[5, 6, 7, 8], [300, 41, 977, 12, 5], [1500, 1501]]


def engine_text(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[str, str]:
    """The single-process engine's own text (detokenized as it steps) and finish reason."""
    engine.add_request("ref", prompt, params)
    text, reason = "", ""
    while engine.has_unfinished():
        for out in engine.step():
            text += out.new_text
            reason = out.finish_reason or reason
    return text, reason


@pytest.fixture(scope="module")
def reference(tiny_model_path: Path) -> LLMEngine:
    return LLMEngine.from_path(tiny_model_path, num_blocks=64)


@pytest.fixture
def client(tiny_model_path: Path) -> Iterator[tuple[InProcessEngineClient, list[str]]]:
    """The client, and the names of the threads that decoded text on its engine's tokenizer."""
    decoded_on: list[str] = []

    def build() -> LLMEngine:
        engine = LLMEngine.from_path(tiny_model_path, num_blocks=64)
        assert engine.tokenizer is not None
        decode = engine.tokenizer.decode

        def recording_decode(token_ids: list[int], skip_special_tokens: bool = True) -> str:
            decoded_on.append(threading.current_thread().name)
            return decode(token_ids, skip_special_tokens)

        engine.tokenizer.decode = recording_decode  # type: ignore[method-assign]
        return engine

    c = InProcessEngineClient(build=build, num_threads=1)
    try:
        yield c, decoded_on
    finally:
        c.shutdown()


def served_text(
    client: InProcessEngineClient, prompt: list[int], params: SamplingParams, hold: bool
) -> tuple[str, str, int]:
    async def run() -> tuple[str, str, int]:
        text, reason, outputs = "", "", 0
        async for out in client.generate("r", prompt, params, hold_to_end=hold):
            text, outputs = text + out.new_text, outputs + 1
            reason = out.finish_reason or reason
        return text, reason, outputs

    return asyncio.run(run())


@pytest.mark.parametrize("hold", [False, True], ids=["streamed", "held"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_text_made_on_the_loop_matches_the_engines(
    client: tuple[InProcessEngineClient, list[str]],
    reference: LLMEngine,
    prompt: list[int],
    hold: bool,
) -> None:
    c, decoded_on = client
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    text, reason, outputs = served_text(c, prompt, params, hold)
    assert (text, reason) == engine_text(reference, prompt, params)
    assert text  # the model writes something: the comparison is not of two empty strings
    assert ENGINE_THREAD_NAME not in decoded_on
    if hold:  # the first output at once, the rest at the end (one output if they met): two
        # decodes each, where text made per token would take two per token (80 here)
        assert outputs <= 2 and len(decoded_on) <= 2 * outputs


def test_a_stop_string_is_still_decided_in_the_engine(
    client: tuple[InProcessEngineClient, list[str]], reference: LLMEngine
) -> None:
    c, decoded_on = client
    plain = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    full, _ = engine_text(reference, PROMPTS[1], plain)
    stop = full[12:15]
    assert len(stop) == 3 and full.index(stop) < 15  # a stop string that ends the text early
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=(stop,))
    text, reason, _ = served_text(c, PROMPTS[1], params, hold=False)
    assert (text, reason) == engine_text(reference, PROMPTS[1], params)
    assert reason == FinishReason.STOP and text == full[: full.index(stop)]
    assert ENGINE_THREAD_NAME in decoded_on


def test_token_ids_only_callers_get_no_text(
    client: tuple[InProcessEngineClient, list[str]],
) -> None:
    c, decoded_on = client
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False)
    text, reason, _ = served_text(c, PROMPTS[0], params, hold=True)
    assert (text, reason) == ("", FinishReason.LENGTH)
    assert decoded_on == []


def test_a_failing_decode_fails_its_request_alone(
    tiny_model_path: Path, reference: LLMEngine
) -> None:
    # A decode that raises for one request's tokens (a broken tokenizer, a hostile id): that
    # request fails on the loop; the one beside it and the engine thread go on.
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ids_a, ids_b = (reference.generate([p], params)[0] for p in PROMPTS[:2])
    poison = next(t for t in ids_a if t not in ids_b)

    def build() -> LLMEngine:
        engine = LLMEngine.from_path(tiny_model_path, num_blocks=64)
        assert engine.tokenizer is not None
        decode = engine.tokenizer.decode

        def poisoned_decode(token_ids: list[int], skip_special_tokens: bool = True) -> str:
            if poison in token_ids:
                raise ValueError(f"cannot decode {poison}")
            return decode(token_ids, skip_special_tokens)

        engine.tokenizer.decode = poisoned_decode  # type: ignore[method-assign]
        return engine

    c = InProcessEngineClient(build=build, num_threads=1)

    async def one(req_id: str, prompt: list[int]) -> str:
        return "".join([o.new_text async for o in c.generate(req_id, prompt, params)])

    async def both() -> list[str | BaseException]:
        return await asyncio.gather(one("a", PROMPTS[0]), one("b", PROMPTS[1]),
                                    return_exceptions=True)  # fmt: skip

    try:
        failed, text_b = asyncio.run(both())
        assert isinstance(failed, ValueError) and str(poison) in str(failed)
        assert text_b == engine_text(reference, PROMPTS[1], params)[0]
        assert c.alive() and len(c.streams) == 0  # nothing left behind
        assert asyncio.run(one("c", PROMPTS[1])) == text_b
        assert not c.engine.requests  # the failed request was aborted: its KV is free
    finally:
        c.shutdown()
