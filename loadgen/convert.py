"""Write any trace as Mooncake JSONL, the format vLLM bench, SGLang and AIPerf all replay."""

from __future__ import annotations

import os
from collections.abc import Iterable

import msgspec

from loadgen.traces import TraceRow


class _MooncakeOut(msgspec.Struct):
    timestamp: int
    input_length: int
    output_length: int
    hash_ids: list[int]


def write_mooncake_jsonl(rows: Iterable[TraceRow], path: str | os.PathLike[str]) -> int:
    """Write `rows` to `path` as Mooncake JSONL; return the number of rows written.

    Timestamps become integer milliseconds from the first row, rounded (Azure's sub-millisecond
    digits are dropped, as Mooncake's schema has no room for them). Rows without hash_ids get an
    empty list: no prefix sharing is claimed.
    """
    encoder = msgspec.json.Encoder()
    count = 0
    with open(path, "wb") as out:
        for row in rows:
            record = _MooncakeOut(
                timestamp=round(row.arrival_s * 1000.0),
                input_length=row.input_len,
                output_length=row.output_len,
                hash_ids=list(row.hash_ids),
            )
            out.write(encoder.encode(record) + b"\n")
            count += 1
    return count
