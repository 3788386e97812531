"""An engine process decoding several greedy steps a call (`num_scheduler_steps`), on float32 or
bfloat16 KV, killed mid-request: nothing of it outlives the process, and the request re-run
elsewhere from the tokens it had streamed (token replay, as the mesh re-runs a lost request)
continues with exactly the tokens an uninterrupted single-step engine makes. Hostile settings
(a step count far past any request's length) and a batch-mate aborted between calls leave the
other requests' tokens as they were."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO

import pytest

from common.engine.core import LLMEngine
from common.sampling_params import SamplingParams
from tests.e2e.serve_process import REPO

PROMPT = [5, 9, 40, 7, 300, 12, 88, 41, 3, 19]
MAX_TOKENS = 40
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)

# The child: an engine at 8 steps a call; it prints each output's tokens (a line after "tokens",
# among its log lines) and
# waits for a line on stdin before its next call, so the kill lands while its request runs.
CHILD = """
import json, sys
from common.engine.core import LLMEngine
from common.sampling_params import SamplingParams
engine = LLMEngine.from_path(sys.argv[1], num_blocks=64, num_scheduler_steps=8,
                             kv_cache_dtype=sys.argv[2])
engine.add_request("r", json.loads(sys.argv[3]), SamplingParams(
    max_tokens=int(sys.argv[4]), temperature=0.0, ignore_eos=True, detokenize=False))
while engine.has_unfinished():
    for out in engine.step():
        print("tokens", json.dumps(out.new_token_ids), flush=True)
    sys.stdin.readline()
"""


def next_tokens(stdout: IO[str]) -> list[int]:
    while line := stdout.readline():
        if line.startswith("tokens "):
            return json.loads(line.removeprefix("tokens "))
    raise AssertionError("the engine process ended before its next tokens")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16"])
def test_a_killed_engine_mid_request_is_replayed_to_the_same_tokens(
    tiny_model_path: Path, kv_cache_dtype: str
) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tiny_model_path), kv_cache_dtype, json.dumps(PROMPT),
         str(MAX_TOKENS)],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True,
    )  # fmt: skip
    assert child.stdin is not None and child.stdout is not None
    streamed: list[int] = []
    try:
        for _ in range(3):  # the prefill's token, then two calls of several tokens
            streamed += next_tokens(child.stdout)
            child.stdin.write("\n")
            child.stdin.flush()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    assert child.returncode == -signal.SIGKILL
    assert 2 < len(streamed) < MAX_TOKENS  # it died mid-request, several steps a call
    whole = LLMEngine.from_path(tiny_model_path, num_blocks=64, kv_cache_dtype=kv_cache_dtype)
    expected = whole.generate([PROMPT], GREEDY)[0]
    assert streamed == expected[: len(streamed)]
    replay = LLMEngine.from_path(tiny_model_path, num_blocks=64, num_scheduler_steps=8,
                                 kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    rest = SamplingParams(max_tokens=MAX_TOKENS - len(streamed), temperature=0.0,
                          ignore_eos=True, detokenize=False)  # fmt: skip
    assert streamed + replay.generate([PROMPT + streamed], rest)[0] == expected


def test_a_step_count_past_every_length_stops_at_the_request_end(tiny_model_path: Path) -> None:
    """`num_scheduler_steps` of a million: one call runs to the request's end (its max_tokens),
    never past it, with the tokens single steps make."""
    alone = LLMEngine.from_path(tiny_model_path, num_blocks=64).generate([PROMPT], GREEDY)[0]
    engine = LLMEngine.from_path(tiny_model_path, num_blocks=64, num_scheduler_steps=1_000_000)
    engine.add_request("r", PROMPT, GREEDY)
    first = engine.step()[0].new_token_ids  # the prefill's token
    rest = engine.step()[0]
    assert rest.finished and first + rest.new_token_ids == alone
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_a_batch_mate_aborted_between_calls_changes_no_token(tiny_model_path: Path) -> None:
    """A request aborted between two calls of several steps frees its blocks, and its
    batch-mate's tokens are those it makes alone."""
    alone = LLMEngine.from_path(tiny_model_path, num_blocks=64).generate([PROMPT], GREEDY)[0]
    engine = LLMEngine.from_path(tiny_model_path, num_blocks=64, num_scheduler_steps=8)
    engine.add_request("keep", PROMPT, GREEDY)
    engine.add_request("drop", PROMPT[::-1], GREEDY)
    tokens = [t for o in engine.step() if o.req_id == "keep" for t in o.new_token_ids]
    outputs = engine.step()
    assert [len(o.new_token_ids) for o in outputs] == [8, 8]
    tokens += [t for o in outputs if o.req_id == "keep" for t in o.new_token_ids]
    assert engine.abort("drop")
    while engine.has_unfinished():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    assert tokens == alone
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
