"""Readers for the datasets `vllm bench serve` takes beside the production traces: ShareGPT JSON,
BurstGPT CSV, and random fixed lengths.

Each yields `TraceRow`s like the trace readers (`loadgen.traces`), so arrivals, token scaling and
the report work unchanged:

- **ShareGPT** (`[{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}]`):
  the first two turns of each conversation are one request, its prompt text sent as is; the
  lengths are token counts from `count_tokens` (as the endpoint will count the prompt; the reply
  counted the same way, as vLLM counts both with the tokenizer's own special tokens), so a
  tokenizer is needed. No timestamps: every arrival is 0 (send them at
  `--rate`). vLLM's filter applies: prompts or replies under 4 tokens, prompts over 1024 and
  pairs over 2048 are skipped. The file is one JSON document, so it is loaded whole.
- **BurstGPT** (`Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type`): arrivals
  from `Timestamp` (seconds), lengths from the token columns; rows whose `Response tokens` is 0
  (requests that failed in the original service) are skipped, as vLLM's reader does.
- **random**: `num_requests` rows of `input_len`/`output_len` tokens, each drawn uniformly within
  `±range_ratio` of them (0: fixed), all arriving at 0; vLLM's `--dataset-name random`.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable, Iterator

import numpy as np

from loadgen.traces import TraceFormatError, TraceRow

BURSTGPT_HEADER = ("Timestamp", "Model", "Request tokens", "Response tokens")

# vLLM's `is_valid_sequence` bounds for ShareGPT pairs.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


def read_sharegpt_json(
    path: str | os.PathLike[str], count_tokens: Callable[[str], int]
) -> Iterator[TraceRow]:
    """Yield one row per usable conversation, in file order (see the module docstring)."""
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
    except ValueError as exc:
        raise TraceFormatError(path, 1, f"not a JSON document: {exc}") from None
    if not isinstance(entries, list):
        raise TraceFormatError(path, 1, "expected a JSON list of conversations")
    for number, entry in enumerate(entries, start=1):
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list):
            raise TraceFormatError(path, 1, f"entry {number} has no 'conversations' list")
        if len(turns) < 2:
            continue
        prompt, reply = (str(turn.get("value", "")) for turn in turns[:2])
        input_len, output_len = count_tokens(prompt), count_tokens(reply)
        if input_len < SHAREGPT_MIN_LEN or output_len < SHAREGPT_MIN_LEN:
            continue
        if input_len > SHAREGPT_MAX_PROMPT_LEN or input_len + output_len > SHAREGPT_MAX_TOTAL_LEN:
            continue
        yield TraceRow(0.0, input_len, output_len, prompt=prompt)


def read_burstgpt_csv(path: str | os.PathLike[str]) -> Iterator[TraceRow]:
    """Yield the rows of a BurstGPT trace; arrivals relative to the first kept row."""
    first_s: float | None = None
    with open(path, encoding="utf-8", newline="") as f:
        rows = csv.reader(f)
        header = tuple(cell.strip() for cell in next(rows, []))
        if header[: len(BURSTGPT_HEADER)] != BURSTGPT_HEADER:
            raise TraceFormatError(path, 1, f"expected header {','.join(BURSTGPT_HEADER)},...")
        for line_no, cells in enumerate(rows, start=2):
            if not cells or not "".join(cells).strip():
                continue
            try:
                stamp_s, input_len, output_len = _burstgpt_row(cells)
            except ValueError as exc:
                raise TraceFormatError(path, line_no, str(exc)) from None
            if output_len == 0:
                continue
            first_s = stamp_s if first_s is None else first_s
            yield TraceRow(stamp_s - first_s, input_len, output_len)


def _burstgpt_row(cells: list[str]) -> tuple[float, int, int]:
    if len(cells) < len(BURSTGPT_HEADER):
        raise ValueError(f"expected at least {len(BURSTGPT_HEADER)} fields, got {len(cells)}")
    stamp_s = float(cells[0])
    input_len, output_len = int(cells[2]), int(cells[3])
    if input_len < 0 or output_len < 0:
        raise ValueError("negative token count")
    return stamp_s, input_len, output_len


def random_rows(
    num_requests: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0
) -> Iterator[TraceRow]:
    """`num_requests` rows of about `input_len`/`output_len` tokens (see the module docstring)."""
    if input_len < 1 or output_len < 1:
        raise ValueError("--random-input-len and --random-output-len must be at least 1")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)

    def draw(center: int) -> np.ndarray:
        low = max(1, int(center * (1 - range_ratio)))
        high = max(low, int(center * (1 + range_ratio)))
        return rng.integers(low, high + 1, size=num_requests)

    for inputs, outputs in zip(draw(input_len).tolist(), draw(output_len).tolist(), strict=True):
        yield TraceRow(0.0, inputs, outputs)
