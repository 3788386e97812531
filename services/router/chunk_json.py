"""A streamed chunk's JSON from a template cut out of the chunk's own pydantic model.

A stream sends one chunk per token (per choice, per `stream_interval` tokens), and consecutive
chunks of a choice differ only in their text and finish reason. Building each chunk's two or
three pydantic models and serializing them was about a quarter of the Router's own Python per
streamed token (docs/serving.md, "The per-step path of tokens"). So `ChunkTemplate` serializes
the chunk's model once per choice with marker values in those two fields, keeps the bytes around
the markers, and writes each chunk as those bytes around the fields' own JSON, encoded by
`pydantic_core.to_json` (the serializer `model_dump_json` runs): the bytes the model would write.
The model stays the one definition of the chunk: a field added to it reaches the template. Where
the markers cannot be found once each (a model named as one, a model whose finish reason comes
before its text), the chunk goes through the model.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel
from pydantic_core import to_json

# Characters no tokenizer's text and no served model name carries in practice; if one does, the
# template is not used (see `_cut`), never wrong.
_TEXT = "\x00phasemesh-chunk-text\x00"
_FINISH = "\x00phasemesh-chunk-finish\x00"

# index, text, finish reason -> the chunk's model (every other field fixed for the stream)
ChunkBuilder = Callable[[int, str, str | None], BaseModel]


class ChunkTemplate:
    """One stream's text chunks as JSON bytes, byte for byte what `build(...).model_dump_json()`
    writes. `build` must fix every field but the three it takes (`created` included)."""

    def __init__(self, build: ChunkBuilder) -> None:
        self._build = build
        self._cuts: dict[int, tuple[bytes, bytes, bytes] | None] = {}  # per choice index

    def encode(self, index: int, text: str, finish_reason: str | None) -> bytes:
        if index not in self._cuts:
            self._cuts[index] = _cut(self._build(index, _TEXT, _FINISH).model_dump_json().encode())
        cut = self._cuts[index]
        if cut is None:
            return self._build(index, text, finish_reason).model_dump_json().encode()
        head, middle, tail = cut
        finish = b"null" if finish_reason is None else to_json(finish_reason)
        return b"".join((head, to_json(text), middle, finish, tail))


def _cut(marked: bytes) -> tuple[bytes, bytes, bytes] | None:
    """The bytes before the text, between text and finish reason, and after; None unless each
    marker occurs exactly once, text first."""
    text, finish = to_json(_TEXT), to_json(_FINISH)
    if marked.count(text) != 1 or marked.count(finish) != 1:
        return None
    head, rest = marked.split(text)
    if finish not in rest:
        return None
    middle, tail = rest.split(finish)
    return head, middle, tail
