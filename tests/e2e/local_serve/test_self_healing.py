"""End to end: a served mesh loses no request when a replica dies (issue 17's acceptance).

`serve run deploy/local.yaml`; six concurrent greedy streams of a few hundred tokens; then, in turn,
SIGKILL the PromptEngine, the TokenEngine and one AttentionShard replica while the streams are in
flight. Every stream completes with text equal to the single-process engine's (near-ties allowed,
`tests/e2e/greedy_check.py`), and afterwards the mesh is back to idle: no KV held anywhere.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from common.engine.core import LLMEngine
from common.model.default import default_model_path
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer
from tests.e2e.greedy_check import assert_text_greedy_close
from tests.e2e.serve_process import ServeRun, replica_pid

pytestmark = pytest.mark.timeout(900)

MODEL = "tiny"
NUM_STREAMS = 6
NUM_TOKENS = 200


def prompts(seed: int) -> list[list[int]]:
    return [[(seed * 97 + i * 31 + j * 7) % 1900 + 50 for j in range(20 + 13 * i)] for i in
            range(NUM_STREAMS)]  # fmt: skip


def stream_all(
    server: ServeRun,
    prompt_ids: list[list[int]],
    started: threading.Barrier,
    num_tokens: int = NUM_TOKENS,
) -> list:
    """Stream every prompt concurrently; `started` trips once each has a few tokens."""

    def one(ids: list[int]) -> str:
        with openai.OpenAI(base_url=server.base_url + "/v1", api_key="-", max_retries=0,
                           timeout=300) as client:  # fmt: skip
            chunks = client.completions.create(
                model=MODEL, prompt=ids, max_tokens=num_tokens, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            text, seen = "", 0
            for chunk in chunks:
                text += chunk.choices[0].text
                seen += 1
                if seen == 5:
                    started.wait(timeout=120)
            return text

    with ThreadPoolExecutor(len(prompt_ids)) as pool:
        return list(pool.map(one, prompt_ids))


def kv_in_use(server: ServeRun) -> dict:
    return httpx.get(server.base_url + "/stats", timeout=10).json()


def wait_idle(server: ServeRun, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        current = kv_in_use(server)
        idle = current["kv_blocks_used"] == 0 and current["num_engine_requests"] == 0
        if idle or time.monotonic() > deadline:
            return current
        time.sleep(0.5)  # NOTE: frees travel router -> engines -> shards asynchronously


@pytest.mark.parametrize("victim", ["TokenEngine", "AttentionShard", "PromptEngine"])
def test_streams_survive_a_killed_replica(
    server: ServeRun, reference: tuple[LLMEngine, Tokenizer], victim: str
) -> None:
    engine, tokenizer = reference
    prompt_ids = prompts(seed=len(victim))
    expected = engine.generate(
        prompt_ids, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    )
    started = threading.Barrier(NUM_STREAMS + 1)
    with ThreadPoolExecutor(1) as runner:
        texts = runner.submit(stream_all, server, prompt_ids, started)
        try:
            started.wait(timeout=120)  # every stream is decoding now
        except threading.BrokenBarrierError:  # say why: what the streams raised, the mesh's state
            pytest.fail(f"not every stream was decoding within 120 s, before any kill: the "
                        f"streams ended with {texts.exception(timeout=300)!r}; the mesh: "
                        f"{kv_in_use(server)}")  # fmt: skip
        killed = replica_pid(server, victim)
        os.kill(killed, signal.SIGKILL)
        results = texts.result(timeout=600)
    for text, ids, ref in zip(results, prompt_ids, expected, strict=True):
        assert_text_greedy_close(text, ids, ref, tokenizer, Path(default_model_path("tiny")))
    current = wait_idle(server)
    assert current["kv_blocks_used"] == 0 and current["num_engine_requests"] == 0, current
    assert all(s["kv_blocks_used"] == 0 for s in current["services"].values()), current
    if victim == "TokenEngine":  # Serve's replacement keeps its OpenMP settings (runtime_env)
        env = replacement_environ(server, victim, killed)
        assert env.get("OMP_WAIT_POLICY") == "passive" and env.get("OMP_NUM_THREADS") == "2"


def replacement_environ(server: ServeRun, deployment: str, killed: int) -> dict[str, str]:
    """The start environment of the replica Serve started in place of `killed`."""
    deadline = time.monotonic() + 120
    while True:
        try:
            pid = replica_pid(server, deployment)
            raw = Path(f"/proc/{pid}/environ").read_bytes()
        except (LookupError, OSError):
            pid = killed  # not (yet) there, or gone meanwhile
        if pid != killed:
            pairs = (item.split("=", 1) for item in raw.decode(errors="replace").split("\0"))
            return {p[0]: p[1] for p in pairs if len(p) == 2}
        assert time.monotonic() < deadline, f"no {deployment} replica replaced {killed}"
        time.sleep(0.5)
