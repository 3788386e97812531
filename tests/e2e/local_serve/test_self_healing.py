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
from tests.e2e.serve_process import ServeRun, descendants, replica_pid, replica_pids_below

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


def test_a_batch_whose_offline_replica_is_killed_mid_job_runs_online(server: ServeRun) -> None:
    """The offline group's replica, which a batch job starts (the deployment scales to zero),
    SIGKILLed while its workers run the job: the router's call to it fails, the batch runs
    through the online API instead, every line answered with the online API's greedy text; and no
    worker of the killed group is left behind."""
    import json

    bodies = [{"model": MODEL, "prompt": f"killed offline {i} is", "max_tokens": 48,
               "temperature": 0} for i in range(6)]  # fmt: skip
    rows = [{"custom_id": f"k{i}", "method": "POST", "url": "/v1/completions", "body": b}
            for i, b in enumerate(bodies)]  # fmt: skip
    assert server.pid is not None
    # A replica an earlier job started (it stays a minute after its last call) would take this
    # job at once, maybe before any kill: wait until it scaled to zero, so that the replica with
    # workers found below is the one this job started, its call already on it.
    deadline = time.monotonic() + 300
    while replica_pids_below(server.pid, "OfflineGroup"):
        assert time.monotonic() < deadline, "the offline group did not scale to zero when idle"
        time.sleep(1)
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="-", max_retries=0,
                       timeout=120) as client:  # fmt: skip
        data = "\n".join(json.dumps(r) for r in rows).encode()
        batch = client.batches.create(
            input_file_id=client.files.create(file=("k.jsonl", data), purpose="batch").id,
            endpoint="/v1/completions", completion_window="24h",
        )  # fmt: skip
        replica, workers = offline_replica_with_workers(server.pid, timeout_s=180)
        os.kill(replica, signal.SIGKILL)
        deadline = time.monotonic() + 300
        while (batch := client.batches.retrieve(batch.id)).status != "completed":
            assert batch.status in ("validating", "in_progress", "finalizing"), batch.status
            assert time.monotonic() < deadline, batch.status
            time.sleep(0.5)
        assert batch.request_counts.completed == len(rows) and batch.output_file_id is not None
        out = [json.loads(line) for line in
               client.files.content(batch.output_file_id).text.splitlines() if line]  # fmt: skip
        for record, body in zip(sorted(out, key=lambda r: r["custom_id"]), bodies, strict=True):
            online = client.completions.create(**body)
            assert record["response"]["body"]["choices"][0]["text"] == online.choices[0].text
    assert "offline job failed; the batch runs online" in server.log_tail(400_000)
    deadline = time.monotonic() + 30
    while (left := [p for p in workers if Path(f"/proc/{p}").exists()]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.5)
    assert not left, f"the killed replica's offline workers {left} outlived it"


def offline_replica_with_workers(root: int, timeout_s: float) -> tuple[int, list[int]]:
    """The offline group's replica once its job's worker processes run, and those workers (the
    processes multiprocessing's fork server, a child of the replica, forked)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for replica in replica_pids_below(root, "OfflineGroup"):
            workers = [w for child in descendants(replica) for w in descendants(child)]
            if workers:
                return replica, workers
        time.sleep(0.1)
    raise TimeoutError(f"no offline replica with workers within {timeout_s} s")
