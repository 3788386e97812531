"""`bench/null_engine.py`'s `NullEngineFake` keeps `LLMEngine`'s contract where the router sees it:
as many tokens as asked, then `length`; the same refusals of a bad request; through the real
`Router` and `InProcessEngineClient`, the stream the official client reads is complete."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import openai
import pytest

from common.engine.core import LLMEngine
from common.sampling import SamplingParams
from services.router.engine_client import InProcessEngineClient
from services.router.server import Router

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `bench` (no package of its own)
from bench.null_engine import NullEngineFake  # noqa: E402


def run_to_end(engine: NullEngineFake | LLMEngine, max_tokens: int) -> list[tuple[int, str | None]]:
    """(number of new tokens, finish reason) of each output of one request, to its end."""
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    seen = []
    while engine.has_unfinished():
        seen += [(len(o.new_token_ids), o.finish_reason) for o in engine.step() if o.req_id == "r"]
    return seen


def test_fake_ends_where_the_engine_does(tiny_model_path: Path) -> None:
    fake = NullEngineFake(tiny_model_path)
    real = LLMEngine.from_path(tiny_model_path, num_blocks=64)
    assert run_to_end(fake, 5) == run_to_end(real, 5)
    assert not fake.requests


def test_fake_refuses_what_the_engine_refuses(tiny_model_path: Path) -> None:
    fake = NullEngineFake(tiny_model_path)
    fake.add_request("a", [1, 2])
    for req_id, prompt in (("a", [1]), ("b", []), ("c", [fake.vocab_size])):
        with pytest.raises(ValueError):
            fake.add_request(req_id, prompt)
    assert fake.abort("a") and not fake.has_unfinished()


def test_fake_streams_through_the_real_router(tiny_model_path: Path) -> None:
    client = InProcessEngineClient(NullEngineFake(tiny_model_path))  # type: ignore[arg-type]
    router = Router(client, tiny_model_path, "tiny")

    async def stream() -> tuple[int, int]:
        transport = httpx.ASGITransport(app=router.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as http:
            api = openai.AsyncOpenAI(base_url="http://router/v1", api_key="-", http_client=http)
            chunks = await api.completions.create(
                model="tiny", prompt=[5, 6], max_tokens=12, stream=True,
                stream_options={"include_usage": True},
            )  # fmt: skip
            texts, usage = 0, 0
            async for chunk in chunks:
                texts += bool(chunk.choices and chunk.choices[0].text)
                usage = chunk.usage.completion_tokens if chunk.usage else usage
            return texts, usage

    try:
        texts, usage = asyncio.run(stream())
    finally:
        client.shutdown()
    assert usage == 12 and 1 <= texts <= 12
