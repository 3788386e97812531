"""ShareGPT, BurstGPT and random readers on small files the tests write, with the expected rows
worked out here from the files' own numbers (and, for ShareGPT, Hugging Face `tokenizers`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from loadgen.arrivals import ArrivalConfig, plan_requests
from loadgen.datasets import random_rows, read_burstgpt_csv
from loadgen.http_target import OpenAIStreamingTarget
from loadgen.traces import TraceFormatError, TraceRow, read_trace, trace_format


def conversation(*turns: str) -> dict[str, object]:
    turns_ = [{"from": ("human", "gpt")[i % 2], "value": text} for i, text in enumerate(turns)]
    return {"id": "x", "conversations": turns_}


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_path: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model_path / "tokenizer.json"))


def test_sharegpt_keeps_first_two_turns_counted_and_applies_vllms_filter(
    tmp_path: Path, hf_tokenizer: Tokenizer
) -> None:
    def count(text: str) -> int:
        return len(hf_tokenizer.encode(text).ids)

    kept_prompt = "Tell me about the tides of the northern sea, briefly please."
    kept_reply = "The tides rise and fall twice a day as the moon pulls the water."
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([
        conversation(kept_prompt, kept_reply, "and a follow-up turn that is ignored"),
        conversation("only one turn"),  # fewer than two turns: skipped
        conversation("A question long enough to count here?", ""),  # reply under 4 tokens
        conversation("word " * 1100, "a reply of several words here"),  # prompt over 1024
    ]))  # fmt: skip
    assert trace_format(path) == "sharegpt"
    rows = list(read_trace(path, count))
    assert rows == [TraceRow(0.0, count(kept_prompt), count(kept_reply), prompt=kept_prompt)]
    with pytest.raises(ValueError, match="needs --tokenizer"):
        read_trace(path)

    # The text is sent as is while lengths are unscaled; scaled lengths get built prompts.
    def first_spec(scale: float):  # type: ignore[no-untyped-def]
        config = ArrivalConfig(mode="poisson", rate=float("inf"), token_scale=scale)
        return next(plan_requests(rows, config))

    assert first_spec(1.0).prompt_text == kept_prompt and first_spec(0.5).prompt_text is None
    target = OpenAIStreamingTarget("http://unused", "m", endpoint="chat")
    assert target.request_body(first_spec(1.0))["messages"][0]["content"] == kept_prompt


def test_sharegpt_that_is_not_a_list_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('[{"id": 1}]')
    with pytest.raises(TraceFormatError, match=r"bad.json:1: entry 1 has no 'conversations'"):
        list(read_trace(path, len))


BURSTGPT = (
    "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
    "5,ChatGPT,472,18,490,Conversation log\n"
    "45,GPT-4,1087,0,1087,Conversation log\n"  # a failed request: no response
    "47.5,ChatGPT,417,30,447,API log\n"
)


def test_burstgpt_arrivals_lengths_and_failed_rows_skipped(tmp_path: Path) -> None:
    path = tmp_path / "burst.csv"
    path.write_text(BURSTGPT)
    assert trace_format(path) == "burstgpt"
    assert list(read_trace(path)) == [TraceRow(0.0, 472, 18), TraceRow(42.5, 417, 30)]
    path.write_text(BURSTGPT + "50,GPT-4,many,3,3,API log\n")
    with pytest.raises(TraceFormatError, match=r"burst.csv:5:"):
        list(read_burstgpt_csv(path))


def test_random_lengths_are_fixed_or_within_the_ratio_and_arrive_at_once() -> None:
    assert list(random_rows(3, 100, 7)) == [TraceRow(0.0, 100, 7)] * 3
    rows = list(random_rows(200, 100, 10, range_ratio=0.5, seed=1))
    assert {r.input_len for r in rows} <= set(range(50, 151)) and len(
        {r.input_len for r in rows}
    ) > 20
    assert rows == list(random_rows(200, 100, 10, range_ratio=0.5, seed=1))  # seeded
    config = ArrivalConfig(mode="poisson", rate=float("inf"), num_requests=3)
    assert [s.arrival_s for s in plan_requests(rows, config)] == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="range-ratio"):
        list(random_rows(1, 10, 10, range_ratio=1.5))
