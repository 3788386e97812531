"""`ChunkTemplate` writes what the chunk's pydantic model writes, byte for byte, and the shapes
write every text chunk of a stream through it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.engine.request import FinishReason, RequestOutput
from services.router.chunk_json import _FINISH, _TEXT, ChunkTemplate
from services.router.logprobs_format import LogprobsFormatter
from services.router.openai_api import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
)
from services.router.responses import ChatShapes, CompletionShapes
from services.router.sse import _sse

FINISH = st.one_of(st.none(), st.sampled_from(list(FinishReason)), st.text())  # enum members too


def completion_builder(req_id: str, model: str, created: int):
    def build(index: int, text: str, finish_reason: str | None) -> CompletionResponse:
        choice = CompletionChoice(index=index, text=text, finish_reason=finish_reason)
        return CompletionResponse(id=req_id, created=created, model=model, choices=[choice])

    return build


def chat_builder(req_id: str, model: str, created: int):
    def build(index: int, text: str, finish_reason: str | None) -> ChatCompletionChunk:
        choice = ChatChunkChoice(
            index=index, delta=DeltaMessage(content=text), finish_reason=finish_reason
        )
        return ChatCompletionChunk(id=req_id, created=created, model=model, choices=[choice])

    return build


@given(
    req_id=st.text(), model=st.text(), created=st.integers(0, 2**40),
    index=st.integers(0, 1000), text=st.text(), finish_reason=FINISH,
    chat=st.booleans(),
)  # fmt: skip
def test_template_writes_the_models_bytes(
    req_id: str, model: str, created: int, index: int, text: str, finish_reason: str | None,
    chat: bool,
) -> None:  # fmt: skip
    build = (chat_builder if chat else completion_builder)(req_id, model, created)
    template = ChunkTemplate(build)
    for _ in range(2):  # the second from the cut it kept
        got = template.encode(index, text, finish_reason)
        assert got == build(index, text, finish_reason).model_dump_json().encode()


def test_template_around_a_marker_elsewhere_goes_through_the_model() -> None:
    """A model named exactly as a marker cannot be cut around: its chunks go through the model,
    and still come out right (a name that only holds one is cut around: the quotes differ)."""
    for name, cut in ((_TEXT, False), (_FINISH, False), (f"model{_TEXT}", True)):
        build = completion_builder("cmpl-1", name, 1)
        template = ChunkTemplate(build)
        got = template.encode(0, 'hi "there"\n', "stop")
        assert got == build(0, 'hi "there"\n', "stop").model_dump_json().encode()
        assert (template._cuts[0] is not None) == cut


async def _outputs(texts: list[str]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    for i, text in enumerate(texts):
        last = i == len(texts) - 1
        yield 0, RequestOutput(
            req_id="r", new_token_ids=[i], new_text=text, num_output_tokens=i + 1,
            finish_reason=FinishReason.LENGTH if last else None,
        )  # fmt: skip


async def _collect(chunks: AsyncGenerator) -> list:
    return [c async for c in chunks]


def test_completion_stream_chunks_parse_as_the_model_and_share_created() -> None:
    request = CompletionRequest(model="m", prompt="x", stream=True,
                                stream_options={"include_usage": True})  # fmt: skip
    shapes = CompletionShapes("cmpl-1", "m", LogprobsFormatter(None), request, [[1, 2]], [""])
    chunks = asyncio.run(_collect(shapes.chunks(_outputs(["a", "é\n", "\x00"]))))
    text = [c for c in chunks if isinstance(c, bytes)]
    assert len(text) == 3  # every text chunk from the template; the usage one from its model
    parsed = [CompletionResponse.model_validate_json(c) for c in text]
    assert [p.choices[0].text for p in parsed] == ["a", "é\n", "\x00"]
    assert [p.choices[0].finish_reason for p in parsed] == [None, None, "length"]
    assert {p.created for p in parsed} == {chunks[-1].created}
    assert chunks[-1].usage.completion_tokens == 3


def test_chat_stream_chunks_parse_as_the_model() -> None:
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                    stream=True)  # fmt: skip
    shapes = ChatShapes("chatcmpl-1", "m", LogprobsFormatter(None), request, [1, 2])
    chunks = asyncio.run(_collect(shapes.chunks(_outputs(["a", "b"]))))
    assert chunks[0].choices[0].delta.role == "assistant"  # the role chunk: from its model
    parsed = [json.loads(c) for c in chunks[1:]]
    assert [p["choices"][0]["delta"] for p in parsed] == [
        {"role": None, "content": "a"},
        {"role": None, "content": "b"},
    ]
    assert parsed[-1]["choices"][0]["finish_reason"] == "length"
    assert {p["created"] for p in parsed} == {chunks[0].created}


def test_text_json_cannot_write_fails_as_the_model_and_the_stream_says_so_in_band() -> None:
    """A text the serializer refuses (a lone surrogate) fails the template as it fails the model,
    and the stream reports it in-band and still ends with [DONE]: the client is not left hanging."""
    bad = "a\ud800b"
    build = completion_builder("cmpl-1", "m", 1)
    with pytest.raises(Exception) as from_model:
        build(0, bad, None).model_dump_json()
    with pytest.raises(Exception) as from_template:
        ChunkTemplate(build).encode(0, bad, None)
    assert type(from_template.value) is type(from_model.value)

    request = CompletionRequest(model="m", prompt="x", stream=True)
    shapes = CompletionShapes("cmpl-1", "m", LogprobsFormatter(None), request, [[1, 2]], [""])
    events = asyncio.run(_collect(_sse(shapes.chunks(_outputs(["ok", bad, "never"])))))
    first = CompletionResponse.model_validate_json(events[0].removeprefix(b"data: "))
    assert first.choices[0].text == "ok"
    assert b"generation failed" in events[1] and b"error" in events[1]
    assert events[2:] == [b"data: [DONE]\n\n"]
