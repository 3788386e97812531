"""End to end: the registry actor stopped (SIGSTOP) for 10 s while six greedy streams run on
`serve run deploy/local.yaml`. Its outage is its own trouble: no replica fails its health check
(before, every replica's check wanted a heartbeat younger than 5 s, and Serve replaced the whole
mesh), so every replica keeps its process and every stream completes, token for token as the
single-process engine decodes it (near-ties allowed, `tests/e2e/greedy_check.py`)."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from common.engine.core import LLMEngine
from common.model.default import default_model_path
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer
from tests.e2e.greedy_check import assert_text_greedy_close
from tests.e2e.local_serve.test_self_healing import NUM_STREAMS, prompts, stream_all
from tests.e2e.serve_process import ServeRun, registry_pid, replica_pid

pytestmark = pytest.mark.timeout(900)

DEPLOYMENTS = ("Router", "PromptEngine", "TokenEngine", "AttentionShard")
OUTAGE_S = 15.0
NUM_TOKENS = 300  # long enough to run through the outage


def test_a_stopped_registry_restarts_no_replica_and_loses_no_stream(
    server: ServeRun, reference: tuple[LLMEngine, Tokenizer]
) -> None:
    engine, tokenizer = reference
    prompt_ids = prompts(seed=7)[:NUM_STREAMS]
    expected = engine.generate(
        prompt_ids, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    )
    pids = {d: replica_pid(server, d) for d in DEPLOYMENTS}
    registry = registry_pid(server)
    started = threading.Barrier(NUM_STREAMS + 1)
    with ThreadPoolExecutor(1) as runner:
        texts = runner.submit(stream_all, server, prompt_ids, started, NUM_TOKENS)
        started.wait(timeout=120)  # every stream is decoding now
        os.kill(registry, signal.SIGSTOP)
        try:
            time.sleep(OUTAGE_S)  # the outage itself: nothing to wait for but the clock
        finally:
            os.kill(registry, signal.SIGCONT)
        results = texts.result(timeout=600)
    for text, ids, ref in zip(results, prompt_ids, expected, strict=True):
        assert_text_greedy_close(text, ids, ref, tokenizer, Path(default_model_path("tiny")))
    time.sleep(2 * 2)  # two of the mesh's health-check periods after the outage
    assert {d: replica_pid(server, d) for d in DEPLOYMENTS} == pids
