"""`InProcessEngineClient(build=...)`: the engine is made on the thread that steps it, so every
torch op of the engine runs on one thread (one OpenMP team: see the class's docstring for the
half-speed GEMMs two teams cost on 2 cores); a build that fails fails the constructor."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from common.engine.core import LLMEngine
from common.sampling_params import SamplingParams
from services.router.engine_client import ENGINE_THREAD_NAME, InProcessEngineClient


def test_the_engine_is_built_and_stepped_on_its_own_thread(tiny_model_path: Path) -> None:
    built_on: list[str] = []

    def build() -> LLMEngine:
        built_on.append(threading.current_thread().name)
        return LLMEngine.from_path(tiny_model_path, num_blocks=64)

    client = InProcessEngineClient(build=build, num_threads=1)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def run() -> list[int]:
        return [t async for o in client.generate("r", [5, 6, 7], params) for t in o.new_token_ids]

    try:
        tokens = asyncio.run(run())
        assert built_on == [ENGINE_THREAD_NAME]
        assert client.max_context == client.engine.max_model_len
        assert client.stats().kv_blocks_total == 64
    finally:
        client.shutdown()
    expected = LLMEngine.from_path(tiny_model_path, num_blocks=64).generate([[5, 6, 7]], params)
    assert tokens == expected[0]


def test_a_local_routers_engine_streams_several_steps_a_call_as_single_steps(
    tiny_model_path: Path,
) -> None:
    """`engine.num_scheduler_steps` of `topology: local`: the client streams the tokens and text
    of the single-step engine, several tokens an output, and a stop string still ends the text
    where it does there."""
    from services.app_args import EngineArgs

    # As services/app.py builds it: EngineArgs are `from_path`'s keywords.
    options = EngineArgs(num_blocks=64, num_scheduler_steps=4).model_dump(exclude={"num_threads"})
    client = InProcessEngineClient(
        build=lambda: LLMEngine.from_path(tiny_model_path, **options), num_threads=1
    )
    single = LLMEngine.from_path(tiny_model_path, num_blocks=64)
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    whole = "".join(o.new_text for o in _drain(single, [5, 6, 7], plain))
    stop = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[whole[20:23]])

    async def run(params: SamplingParams) -> tuple[list[list[int]], str]:
        outputs = [o async for o in client.generate("r", [5, 6, 7], params)]
        return [o.new_token_ids for o in outputs], "".join(o.new_text for o in outputs)

    try:
        chunks, text = asyncio.run(run(plain))
        stopped = asyncio.run(run(stop))[1]
    finally:
        client.shutdown()
    assert [t for c in chunks for t in c] == single.generate([[5, 6, 7]], plain)[0]
    assert text == whole and max(map(len, chunks)) > 1
    assert stopped == whole[:20]


def _drain(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list:  # type: ignore[type-arg]
    engine.add_request("d", prompt, params)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    return outputs


def test_a_build_that_fails_fails_the_constructor_and_leaves_no_thread() -> None:
    def broken() -> LLMEngine:
        raise FileNotFoundError("no model at /nowhere")

    def engine_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == ENGINE_THREAD_NAME}

    before = engine_threads()  # another test's client, not shut down yet, is not this one's
    with pytest.raises(FileNotFoundError, match="/nowhere"):
        InProcessEngineClient(build=broken)
    assert engine_threads() <= before
    with pytest.raises(ValueError, match="not both"):
        InProcessEngineClient()
