"""Autoscaling on a real `serve run` (issue 50): PromptEngine 1 -> 2 -> 1 on its own load, and a
token engine with its shard group 1 -> 2 -> 1 on theirs.

deploy/local.yaml on the tiny preset, its PromptEngine, TokenEngine and AttentionShard given an
`autoscaling_config` and the application `MeshAppAutoscalingPolicy` (docs/deployment.md#autoscaling:
pending prompt tokens for prompt engines; running decode tokens for token engines, their shards'
KV fill beside them, a token engine and its 2 shards scaled as one), its delays, cool-down,
warm-up and Serve's look-back window short so that one test sees every change. Serve's requests
never reach the engines (they come over ZeroMQ), so only the replicas' own load reports
(`record_autoscaling_stats`) can move the counts.

1. A burst of long prompts (prefill only: one token each, so no token engine holds them) from
   many clients at once scales PromptEngine to 2 replicas: Serve's controller starts a second
   replica process and says so, the new engine joins routing and takes prompts. The burst
   lasts past the router's home-role threshold (`mesh.pools.home_roles`, short hold and
   cool-down here): the token engine's home moves to mixed while it decodes a greedy stream
   that runs beside the burst, and moves back to token once the burst has ended (issue 50's
   home-role acceptance, on Serve; tests/integration/test_home_roles.py shows the same on a
   LocalMesh in detail).
2. The burst ends; long greedy decodes of short prompts follow (a KV-heavy step): PromptEngine
   goes back to 1 (the leaving replica drains: `MeshReplica.shutdown`) while TokenEngine goes to
   2 and AttentionShard to 4 in the same decision; the new token engine claims the new group and
   takes requests.
3. The decodes end; a trickle of short streams keeps requests in flight while the token engine
   and its group leave again: the engine drains, its shards serve it until it has left.

Every request answers 200, and every greedy text equals the single-process engine's (the
streams the moved engine decoded among them).
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
import yaml

from common.engine.core import LLMEngine
from common.model.default import default_model_path
from common.sampling import SamplingParams
from common.tokenizer import Tokenizer
from tests.e2e.greedy_check import assert_text_greedy_close
from tests.e2e.serve_process import REPO, ServeRun, replica_pids_below, served

pytestmark = [
    pytest.mark.timeout(400),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # pydantic v1-style fields in Ray
]

PROMPT_TARGET = 16  # pending prompt tokens one prompt engine carries: a burst is far above it
DECODE_TARGET = 192  # running decode tokens one token engine carries: the decode step is above it
SHARDS_PER_GROUP = 2  # the tiny preset's (tests/e2e/serve_process.py PRESET_SHARDS)
# The knobs are short so that the test sees every change; deploy/cluster.yaml has real ones.
KNOBS = {"upscale_after_s": 1.0, "downscale_after_s": 3.0, "cooldown_s": 3.0, "warmup_s": 2.0}
AUTOSCALING_POLICY = {
    "policy_function": "services.mesh.autoscaling:MeshAppAutoscalingPolicy",
    "policy_kwargs": {
        "PromptEngine": {"targets": {"pending_prompt_tokens": PROMPT_TARGET}, **KNOBS},
        "TokenEngine": {"targets": {"running_decode_tokens": DECODE_TARGET}, **KNOBS},
        "AttentionShard": {"targets": {"kv_fill": 0.6}, "group_size": SHARDS_PER_GROUP},
    },
}
SERVE_WINDOW = {
    "upscale_delay_s": 0,  # the policy's own delays apply
    "downscale_delay_s": 0,
    "look_back_period_s": 2.0,  # Serve averages each signal over this window
    "metrics_interval_s": 0.5,  # how often replicas push their reports (Ray 2.60 reads it here)
}


def scaling(low: int, high: int) -> dict[str, Any]:
    """A deployment's `autoscaling_config`: its bounds; the application's policy decides."""
    return {"min_replicas": low, "max_replicas": high, "initial_replicas": low, **SERVE_WINDOW}


DEPLOYMENTS = {
    "PromptEngine": {"num_replicas": None, "autoscaling_config": scaling(1, 2)},
    "TokenEngine": {"num_replicas": None, "autoscaling_config": scaling(1, 2)},
    "AttentionShard": {"num_replicas": None,
                       "autoscaling_config": scaling(SHARDS_PER_GROUP, 2 * SHARDS_PER_GROUP)},
}  # fmt: skip
BURST_CLIENTS = 12
BURST_PROMPT_LEN = 512
BURST_TOKENS = 1  # prefill only: the prompt engine's first token ends it
BURST_GREEDY_EVERY = 4  # the others sample: load alike, no reference to compute for them
DECODE_CLIENTS = 6
DECODE_PROMPT_LEN = 8
DECODE_TOKENS = 96
DECODE_GREEDY_EVERY = 4  # the others sample (seeded): the reference check stays short
# Beside the burst, one client's greedy decodes back to back, so that the token engine decodes
# whenever its home moves; short ones (each well under one token engine's DECODE_TARGET, and
# few tokens each to compare with the reference).
HELD_CLIENTS, HELD_PROMPT_LEN, HELD_TOKENS = 1, 8, 48
# A prompt engine counts as full at 256 pending tokens (the burst's queue is far past it): the
# prompt side's fill is far over the decode side's for longer than the hold, so a home moves;
# once the burst ends the two settle and it moves back, each within a few seconds.
POOLS = {
    "prompt_tokens": 256,
    "home_roles": {"shift": 0.5, "settle": 0.1, "hold_s": 1.0, "cooldown_s": 2.0},
}
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


def wait_while(clients: Clients, what: str, check: Callable[[], Any], timeout_s: float) -> None:
    """`wait_for` while `clients` run: a failed request ends the wait (the test then says why)."""
    wait_for(what, lambda: check() or clients.failures, timeout_s)


def services_of(server: ServeRun, role: str) -> dict[str, Any]:
    """The services of a role the router routes to (its registry view, asked on their sockets)."""
    services = httpx.get(server.base_url + "/stats", timeout=30).json()["services"]
    return {sid: s for sid, s in services.items() if s["home_role"] == role}


def served_by(server: ServeRun, prefix: str) -> dict[str, int]:
    """Requests the router placed on each engine whose id starts with `prefix`."""
    counts = httpx.get(server.base_url + "/stats", timeout=30).json()["requests_by_engine"]
    return {e: n for e, n in counts.items() if e.startswith(prefix)}


def token_homes(server: ServeRun) -> dict[str, tuple[str, int]]:
    """Each token engine's home role and the requests it holds (`/stats`)."""
    services = httpx.get(server.base_url + "/stats", timeout=30).json()["services"]
    return {sid: (s["home_role"], s["num_requests"]) for sid, s in services.items()
            if sid.startswith("token")}  # fmt: skip


def mesh_args() -> dict[str, Any]:
    """deploy/local.yaml's mesh with `POOLS` (the fixture's `args` replace whole keys)."""
    config = yaml.safe_load((REPO / "deploy" / "local.yaml").read_text())
    return {"offline": None, "mesh": config["applications"][0]["args"]["mesh"] | {"pools": POOLS}}


def controller_said(server: ServeRun, deployment: str, change: str) -> bool:
    """Serve's controller logged this change of a deployment's replica count (`serve run`'s
    output carries the controller's log; `serve status` shows the same message)."""
    return any(
        deployment in line and change in line
        for line in server.log_path.read_text(errors="replace").splitlines()
    )


def test_load_steps_scale_prompt_engines_and_token_engine_groups_1_2_1_losing_no_request(
    tmp_path: Path,
) -> None:
    started = time.monotonic()
    with served(
        "local.yaml", tmp_path, args=mesh_args(), deployments=DEPLOYMENTS,
        app_options={"autoscaling_policy": AUTOSCALING_POLICY},
    ) as server:  # fmt: skip
        ready_at = time.monotonic()
        assert server.pid is not None
        pid = server.pid
        count = lambda name: len(replica_pids_below(pid, name))  # noqa: E731
        counts = lambda: tuple(map(count, ("PromptEngine", "TokenEngine", "AttentionShard")))  # noqa: E731
        assert counts() == (1, 1, SHARDS_PER_GROUP) and len(services_of(server, "prompt")) == 1
        moved: list[str] = []  # token engines seen at a home other than token, decoding
        held = Clients(server.base_url, HELD_CLIENTS, HELD_PROMPT_LEN, HELD_TOKENS, 3_000_000)
        with held, Clients(server.base_url, BURST_CLIENTS, BURST_PROMPT_LEN, BURST_TOKENS, 0,
                           BURST_GREEDY_EVERY) as burst:  # fmt: skip

            def moved_while_decoding() -> bool:
                """A token engine away from its home, holding requests (the held stream
                decodes on the only token engine all along; its prefills of the burst too)."""
                moved.extend(sid for sid, (home, num_requests) in token_homes(server).items()
                             if home != "token" and num_requests)  # fmt: skip
                return bool(moved)

            wait_while(burst, "a decoding token engine's home moved toward prompt",
                       moved_while_decoding, 120)  # fmt: skip
            wait_while(burst, "a second PromptEngine replica",
                       lambda: count("PromptEngine") == 2, 180)  # fmt: skip
            wait_while(burst, "2 prompt engines in routing",
                       lambda: len(services_of(server, "prompt")) == 2, 120)  # fmt: skip
            wait_while(burst, "both prompt engines taking prompts",
                       lambda: len(served_by(server, "prompt")) == 2, 60)  # fmt: skip
        prompt_up_at = time.monotonic()
        assert not burst.failures and not held.failures, (burst.failures + held.failures)[:5]
        # The burst is over: the moved home goes back (its decodes finished where they ran).
        wait_for("the token engine's home back to token", lambda: all(
            home == "token" for home, _ in token_homes(server).values()), 60)  # fmt: skip
        assert services_of(server, "token")[moved[0]]["num_home_moves"] >= 2
        assert count("TokenEngine") == 1  # prefill only: nothing for the token engines
        assert controller_said(server, "PromptEngine", "from 1 to 2"), server.log_tail()

        # Long decodes of short prompts: the prompt engines idle, the token engine's KV grows.
        with Clients(server.base_url, DECODE_CLIENTS, DECODE_PROMPT_LEN, DECODE_TOKENS,
                     1_000_000, DECODE_GREEDY_EVERY) as decodes:  # fmt: skip
            wait_while(decodes, "PromptEngine back to 1, a token engine with its group added",
                       lambda: counts() == (1, 2, 2 * SHARDS_PER_GROUP), 180)  # fmt: skip
            wait_while(decodes, "2 token engines and their shards in routing", lambda: (
                len(services_of(server, "token")) == 2
                and len(services_of(server, "shard")) == 2 * SHARDS_PER_GROUP), 120)  # fmt: skip
            wait_while(decodes, "both token engines decoding",
                       lambda: len(served_by(server, "token")) == 2, 60)  # fmt: skip
        group_up_at = time.monotonic()
        assert not decodes.failures, decodes.failures[:5]
        assert controller_said(server, "PromptEngine", "from 2 to 1"), server.log_tail()
        assert controller_said(server, "TokenEngine", "from 1 to 2"), server.log_tail()
        assert controller_said(server, "AttentionShard", f"from {SHARDS_PER_GROUP} to "
                               f"{2 * SHARDS_PER_GROUP}"), server.log_tail()  # fmt: skip

        # The decodes are over: short streams keep requests in flight while the group leaves.
        with Clients(server.base_url, TRICKLE_CLIENTS, TRICKLE_PROMPT_LEN, TRICKLE_TOKENS,
                     2_000_000) as trickle:  # fmt: skip
            wait_while(trickle, "the token engine and its group gone again",
                       lambda: counts() == (1, 1, SHARDS_PER_GROUP), 120)  # fmt: skip
            wait_for("1 token engine and its shards in routing", lambda: (
                len(services_of(server, "token")) == 1
                and len(services_of(server, "shard")) == SHARDS_PER_GROUP), 60)  # fmt: skip
            num_before = trickle.num_ok
            wait_for("requests after the scale-down", lambda: trickle.num_ok > num_before + 2,
                     60)  # fmt: skip
        assert not trickle.failures, trickle.failures[:5]
        assert controller_said(server, "TokenEngine", "from 2 to 1"), server.log_tail()
        assert controller_said(server, "AttentionShard", f"from {2 * SHARDS_PER_GROUP} to "
                               f"{SHARDS_PER_GROUP}"), server.log_tail()  # fmt: skip
        # The leaving replicas drained: no request lost its engine, none outlived the drain, no
        # shard left before the token engine that held it.
        log = server.log_path.read_text(errors="replace")
        for trouble in ("engine left mid-request", "drain time over", "still holds it"):
            assert trouble not in log, trouble
        print(f"autoscale e2e: ready after {ready_at - started:.0f} s, 2 prompt engines "
              f"serving {prompt_up_at - ready_at:.0f} s later, 2 groups after another "
              f"{group_up_at - prompt_up_at:.0f} s, back to 1 after another "
              f"{time.monotonic() - group_up_at:.0f} s; {burst.num_ok} burst, "
              f"{decodes.num_ok} decode and {trickle.num_ok} trickle requests")  # fmt: skip

    path = default_model_path("tiny")
    engine, tokenizer = LLMEngine.from_path(path, num_blocks=1024), Tokenizer(path)
    for clients, length, tokens in ((burst, BURST_PROMPT_LEN, BURST_TOKENS),
                                    (held, HELD_PROMPT_LEN, HELD_TOKENS),
                                    (decodes, DECODE_PROMPT_LEN, DECODE_TOKENS),
                                    (trickle, TRICKLE_PROMPT_LEN, TRICKLE_TOKENS)):  # fmt: skip
        ids = sorted(clients.texts)
        assert len(ids) >= (1 if clients is held else 4), ids  # greedy ones, from each phase
        prompts = [prompt(i, length) for i in ids]
        expected = engine.generate(
            prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        )
        for i, p, ref in zip(ids, prompts, expected, strict=True):
            assert_text_greedy_close(clients.texts[i], p, ref, tokenizer, path)
    print(f"autoscale e2e: {time.monotonic() - started:.0f} s with the greedy check")
