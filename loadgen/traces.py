"""Streaming readers for production request traces: Azure CSV and Mooncake JSONL (and, through
`loadgen.datasets`, ShareGPT JSON and BurstGPT CSV; `read_trace` detects which).

Both readers yield one `TraceRow` per request, in file order, without loading the file. Arrival
times are seconds relative to the first row. A malformed row raises `TraceFormatError` whose message
starts with `path:line:` so the bad row can be found at once.
"""

from __future__ import annotations

import calendar
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")

# Azure stamps: "2023-11-16 18:15:46.6805900" (2023, no zone, 7 fractional digits) and
# "2024-05-10 00:00:01+00:00" / "2024-05-10 00:00:00.009930+00:00" (2024, UTC, fraction optional).
_AZURE_STAMP = re.compile(
    r"^(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?"
    r"(Z|[+-]\d{2}:?\d{2})?$"
)


class TraceFormatError(ValueError):
    """A trace row that cannot be read; the message names the file and the 1-based line."""

    def __init__(self, path: str | os.PathLike[str], line_no: int, reason: str) -> None:
        super().__init__(f"{path}:{line_no}: {reason}")
        self.path = str(path)
        self.line_no = line_no


@dataclass(frozen=True)
class TraceRow:
    """One request of a trace: when it arrives and how long its prompt and output are."""

    arrival_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = field(default=())
    prompt: str | None = None  # the dataset's own prompt text (ShareGPT), sent as is


def shared_dir() -> Path:
    """The shared folder (traces, papers): `$PHASEMESH_SHARED`, else `../shared` from the repo."""
    override = os.environ.get("PHASEMESH_SHARED")
    if override:
        return Path(override)
    return (Path(__file__).resolve().parents[1] / ".." / "shared").resolve()


def parse_azure_timestamp(text: str) -> tuple[int, float]:
    """Split an Azure stamp into (whole epoch seconds, fraction of a second).

    NOTE: kept as two parts because a float epoch loses the 7th fractional digit; callers
    subtract whole seconds first. Stamps without a zone are read as UTC (only differences matter).
    """
    match = _AZURE_STAMP.match(text.strip())
    if match is None:
        raise ValueError(f"bad timestamp {text!r}")
    year, month, day, hour, minute, second = (int(g) for g in match.groups()[:6])
    whole = calendar.timegm((year, month, day, hour, minute, second, 0, 0, 0))
    fraction = float("0." + match.group(7)) if match.group(7) else 0.0
    return whole - _zone_offset_s(match.group(8)), fraction


def _zone_offset_s(zone: str | None) -> int:
    if zone is None or zone == "Z":
        return 0
    sign = -1 if zone[0] == "-" else 1
    digits = zone[1:].replace(":", "")
    return sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)


def _parse_count(text: str, name: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name} is not an integer: {text!r}") from None
    if value < 0:
        raise ValueError(f"{name} is negative: {value}")
    return value


def read_azure_csv(path: str | os.PathLike[str]) -> Iterator[TraceRow]:
    """Yield the rows of an Azure LLM trace (`TIMESTAMP,ContextTokens,GeneratedTokens`)."""
    origin: tuple[int, float] | None = None
    # newline="" keeps CRLF handling to us: strip("\r\n") below, final line may lack a newline.
    with open(path, encoding="utf-8", newline="") as lines:
        header = lines.readline().strip("\r\n").split(",")
        if tuple(h.strip() for h in header) != AZURE_HEADER:
            raise TraceFormatError(path, 1, f"expected header {','.join(AZURE_HEADER)}")
        for line_no, line in enumerate(lines, start=2):
            text = line.strip("\r\n")
            if not text.strip():
                continue
            try:
                whole, fraction, input_len, output_len = _split_azure_row(text)
            except ValueError as exc:
                raise TraceFormatError(path, line_no, str(exc)) from None
            if origin is None:
                origin = (whole, fraction)
            arrival_s = (whole - origin[0]) + (fraction - origin[1])
            yield TraceRow(arrival_s, input_len, output_len)


def _split_azure_row(text: str) -> tuple[int, float, int, int]:
    cells = text.split(",")
    if len(cells) != 3:
        raise ValueError(f"expected 3 comma-separated fields, got {len(cells)}")
    whole, fraction = parse_azure_timestamp(cells[0])
    input_len = _parse_count(cells[1].strip(), "ContextTokens")
    output_len = _parse_count(cells[2].strip(), "GeneratedTokens")
    return whole, fraction, input_len, output_len


class _MooncakeRow(msgspec.Struct, forbid_unknown_fields=False):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int] = []


_MOONCAKE_DECODER = msgspec.json.Decoder(_MooncakeRow)


def read_mooncake_jsonl(path: str | os.PathLike[str]) -> Iterator[TraceRow]:
    """Yield the rows of a Mooncake trace (`timestamp` ms, `input_length`, `output_length`,
    `hash_ids`). Arrivals are relative to the first row's timestamp."""
    first_ms: float | None = None
    with open(path, "rb") as lines:
        for line_no, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = _MOONCAKE_DECODER.decode(line)
            except msgspec.DecodeError as exc:
                raise TraceFormatError(path, line_no, str(exc)) from None
            if row.input_length < 0 or row.output_length < 0:
                raise TraceFormatError(path, line_no, "negative input_length or output_length")
            if first_ms is None:
                first_ms = row.timestamp
            arrival_s = (row.timestamp - first_ms) / 1000.0
            yield TraceRow(arrival_s, row.input_length, row.output_length, tuple(row.hash_ids))


TRACE_FORMATS = ("azure", "mooncake", "sharegpt", "burstgpt")


def trace_format(path: str | os.PathLike[str]) -> str:
    """One of `TRACE_FORMATS`, from the file's first non-blank bytes (extension-agnostic)."""
    with open(path, "rb") as f:
        head = f.read(256).lstrip()
    if head.startswith(b"{"):
        return "mooncake"
    if head.startswith(b"["):
        return "sharegpt"
    if head.upper().startswith(b"TIMESTAMP"):
        return "burstgpt" if head.startswith(b"Timestamp,Model") else "azure"
    raise TraceFormatError(
        path, 1, "not an Azure or BurstGPT CSV header, a Mooncake JSON object or a ShareGPT list"
    )


def read_trace(
    path: str | os.PathLike[str],
    count_tokens: Callable[[str], int] | None = None,
    kind: str | None = None,
) -> Iterator[TraceRow]:
    """Yield the rows of a trace in any of `TRACE_FORMATS` (`kind`, else detected from its
    content). `count_tokens` measures ShareGPT's texts (the served model's tokenizer)."""
    from loadgen import datasets  # it builds on this module's rows

    kind = kind or trace_format(path)
    if kind not in TRACE_FORMATS:
        raise ValueError(f"unknown trace format {kind!r}: one of {', '.join(TRACE_FORMATS)}")
    if kind == "sharegpt":
        if count_tokens is None:
            raise ValueError(f"{path}: a ShareGPT dataset needs --tokenizer to count its tokens")
        return datasets.read_sharegpt_json(path, count_tokens)
    if kind == "burstgpt":
        return datasets.read_burstgpt_csv(path)
    if kind == "mooncake":
        return read_mooncake_jsonl(path)
    return read_azure_csv(path)
