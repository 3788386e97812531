"""Autoscaling on a real `serve run` (issue 50): PromptEngine 1 -> 2 -> 1 on its own load.

deploy/local.yaml on the tiny preset, its PromptEngine given an `autoscaling_config` with
`MeshAutoscalingPolicy` on `pending_prompt_tokens` (docs/deployment.md#autoscaling), its delays,
cool-down, warm-up and Serve's look-back window short so that one test sees both changes. Serve's
requests never reach the engines (they come over ZeroMQ), so only the replicas' own load reports
(`record_autoscaling_stats`) can move the count.

A burst of long prompts from many clients at once scales PromptEngine to 2 replicas: Serve's
controller starts a second replica process and says so, the new engine joins routing and takes
prompts. The burst ends; a trickle of short, decode-heavy streams keeps requests in flight while
the pending prompt tokens fall, and the controller takes PromptEngine back to 1 (the leaving
replica drains: `MeshReplica.shutdown`). Every request answers 200, and every greedy text (every
trickle request's, a share of the burst's) equals the single-process engine's.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from common.engine.core import LLMEngine
from common.model.default import default_model_path
from common.sampling import SamplingParams
from common.tokenizer import Tokenizer
from tests.e2e.greedy_check import assert_text_greedy_close
from tests.e2e.serve_process import ServeRun, replica_pids_below, served

pytestmark = [
    pytest.mark.timeout(400),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # pydantic v1-style fields in Ray
]

PROMPT_TARGET = 16  # pending prompt tokens one prompt engine carries: a burst is far above it
# The knobs are short so that the test sees both changes; deploy/cluster.yaml has real ones.
PROMPT_AUTOSCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    "initial_replicas": 1,
    "upscale_delay_s": 0,  # the policy's own delays apply
    "downscale_delay_s": 0,
    "look_back_period_s": 2.0,  # Serve averages each signal over this window
    "metrics_interval_s": 0.5,  # how often replicas push their reports (Ray 2.60 reads it here)
    "policy": {
        "policy_function": "services.mesh.autoscaling:MeshAutoscalingPolicy",
        "policy_kwargs": {
            "targets": {"pending_prompt_tokens": PROMPT_TARGET},
            "upscale_after_s": 1.0,
            "downscale_after_s": 3.0,
            "cooldown_s": 3.0,
            "warmup_s": 2.0,
        },
    },
}
BURST_CLIENTS = 12
BURST_PROMPT_LEN = 512
BURST_TOKENS = 4
BURST_GREEDY_EVERY = 4  # the others sample: load alike, no reference to compute for them
TRICKLE_CLIENTS = 2
TRICKLE_PROMPT_LEN = 8
TRICKLE_TOKENS = 24


def prompt(i: int, length: int) -> list[int]:
    """Request `i`'s prompt: its first block its own, so no two share a cached prefix."""
    return [(7919 * i + 31 * j) % 2000 + 40 for j in range(length)]


class Clients:
    """Threads posting greedy completions back to back until stopped; every answer is kept."""

    def __init__(self, base_url: str, num_clients: int, prompt_len: int, max_tokens: int,
                 first_id: int, greedy_every: int = 1) -> None:  # fmt: skip
        """Request i is greedy when `greedy_every` divides it, else sampled (seeded)."""
        self.base_url, self.prompt_len, self.max_tokens = base_url, prompt_len, max_tokens
        self.greedy_every = greedy_every
        self.stop = threading.Event()
        self.ids = itertools.count(first_id)
        self.num_ok = 0
        self.texts: dict[int, str] = {}  # the greedy ones'
        self.failures: list[str] = []
        self.num_clients = num_clients
        self._pool = ThreadPoolExecutor(num_clients)

    def _run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=180) as http:
            while not self.stop.is_set():
                i = next(self.ids)
                greedy = i % self.greedy_every == 0
                body = {"model": "tiny", "prompt": prompt(i, self.prompt_len),
                        "max_tokens": self.max_tokens, "temperature": 0 if greedy else 1.0,
                        "seed": i, "ignore_eos": True}  # fmt: skip
                try:
                    response = http.post("/v1/completions", json=body)
                    if response.status_code != 200:
                        self.failures.append(f"{response.status_code}: {response.text[:200]}")
                        continue
                    self.num_ok += 1
                    if greedy:
                        self.texts[i] = response.json()["choices"][0]["text"]
                except Exception as exc:  # noqa: BLE001 - every failure is reported
                    self.failures.append(repr(exc))

    def __enter__(self) -> Clients:
        self._clients = [self._pool.submit(self._run) for _ in range(self.num_clients)]
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self._pool.shutdown(wait=True)  # each client's request in flight finishes first
        for client in self._clients:
            client.result()  # a client thread that raised fails the test


def wait_for(what: str, check: Callable[[], Any], timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.5)  # NOTE: waiting on other processes (Serve's controller); bounded
    raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")


def prompt_engines(server: ServeRun) -> dict[str, Any]:
    """The prompt engines the router routes to (its registry view, asked on their sockets)."""
    services = httpx.get(server.base_url + "/stats", timeout=30).json()["services"]
    return {sid: s for sid, s in services.items() if s["home_role"] == "prompt"}


def served_by_prompt_engines(server: ServeRun) -> dict[str, int]:
    counts = httpx.get(server.base_url + "/stats", timeout=30).json()["requests_by_engine"]
    return {e: n for e, n in counts.items() if e.startswith("prompt")}


def controller_said(server: ServeRun, change: str) -> bool:
    """Serve's controller logged this change of PromptEngine's replica count (`serve run`'s
    output carries the controller's log)."""
    return any(
        "PromptEngine" in line and change in line
        for line in server.log_path.read_text(errors="replace").splitlines()
    )


def test_a_prompt_burst_scales_prompt_engines_1_2_1_without_losing_a_request(
    tmp_path: Path,
) -> None:
    started = time.monotonic()
    with served(
        "local.yaml", tmp_path, args={"offline": None},
        deployments={"PromptEngine": {"num_replicas": None,
                                      "autoscaling_config": PROMPT_AUTOSCALING}},
    ) as server:  # fmt: skip
        ready_at = time.monotonic()
        assert server.pid is not None
        num_replicas = lambda: len(replica_pids_below(server.pid, "PromptEngine"))  # noqa: E731
        assert num_replicas() == 1 and len(prompt_engines(server)) == 1
        with Clients(server.base_url, BURST_CLIENTS, BURST_PROMPT_LEN, BURST_TOKENS, 0,
                     BURST_GREEDY_EVERY) as burst:  # fmt: skip
            wait_for("a second PromptEngine replica",
                     lambda: num_replicas() == 2 or burst.failures, 180)  # fmt: skip
            wait_for("2 prompt engines in routing",
                     lambda: len(prompt_engines(server)) == 2 or burst.failures, 120)  # fmt: skip
            wait_for("both prompt engines taking prompts",
                     lambda: len(served_by_prompt_engines(server)) == 2 or burst.failures,
                     60)  # fmt: skip
        scaled_up_at = time.monotonic()
        assert not burst.failures, burst.failures[:5]
        assert controller_said(server, "from 1 to 2"), server.log_tail()

        # The burst is over: only short prompts now, decoding while PromptEngine shrinks.
        with Clients(server.base_url, TRICKLE_CLIENTS, TRICKLE_PROMPT_LEN, TRICKLE_TOKENS,
                     1_000_000) as trickle:  # fmt: skip
            wait_for("PromptEngine back to 1 replica",
                     lambda: num_replicas() == 1 or trickle.failures, 120)  # fmt: skip
            wait_for("1 prompt engine in routing", lambda: len(prompt_engines(server)) == 1, 60)
            num_before = trickle.num_ok
            wait_for("requests after the scale-down", lambda: trickle.num_ok > num_before + 2,
                     60)  # fmt: skip
        assert not trickle.failures, trickle.failures[:5]
        assert controller_said(server, "from 2 to 1"), server.log_tail()
        # The leaving replica drained: no request lost its engine, none outlived the drain.
        log = server.log_path.read_text(errors="replace")
        assert "engine left mid-request" not in log and "drain time over" not in log
        print(f"autoscale e2e: ready after {ready_at - started:.0f} s, 2 prompt engines "
              f"serving {scaled_up_at - ready_at:.0f} s later, back to 1 after another "
              f"{time.monotonic() - scaled_up_at:.0f} s; {burst.num_ok} burst and "
              f"{trickle.num_ok} trickle requests")  # fmt: skip

    path = default_model_path("tiny")
    engine, tokenizer = LLMEngine.from_path(path, num_blocks=1024), Tokenizer(path)
    for clients, length, tokens in ((burst, BURST_PROMPT_LEN, BURST_TOKENS),
                                    (trickle, TRICKLE_PROMPT_LEN, TRICKLE_TOKENS)):  # fmt: skip
        ids = sorted(clients.texts)
        assert len(ids) >= 4, ids  # greedy requests to check, from each phase
        prompts = [prompt(i, length) for i in ids]
        expected = engine.generate(
            prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        )
        for i, p, ref in zip(ids, prompts, expected, strict=True):
            assert_text_greedy_close(clients.texts[i], p, ref, tokenizer, path)
    print(f"autoscale e2e: {time.monotonic() - started:.0f} s with the greedy check")
