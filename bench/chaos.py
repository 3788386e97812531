"""Chaos: a trace slice replayed against a served mesh while replicas are SIGKILLed, side by side
with the same slice and no faults, in one run.

    python bench/chaos.py [--seconds 60] [--kill-every 15] [--seed 0] [--token-scale 1/16]

Starts `serve run deploy/local.yaml` on a free port (as the e2e tests do), then replays the first
`--seconds` of the Azure conversation trace twice through the OpenAI API (loadgen's open-loop
replay, token counts scaled by `--token-scale` so the tiny model keeps up on a few cores):

1. no faults;
2. every `--kill-every` seconds, SIGKILL a random replica of a random role (PromptEngine,
   TokenEngine or AttentionShard; `--seed`), and time its recovery: from the kill until a probe
   request succeeds and `/stats` lists every service again.

Prints, per run, requests completed, lost (admitted, then failed: the target is 0, since the router
re-runs a request whose replicas die) and refused at admission with a 503 and Retry-After while
no replica of a role is up (a client retries those; the figure is printed, not a target), the
router's migrations (`/metrics`: Ray's
`ray_phasemesh_request_migrations_total`, read before and after), each kill's recovery time, and
TTFT / TBT p50 and p90 of the fault run against the no-fault run. The last line is one JSON object
with the figures, its `targets` and `targets_met`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadgen.arrivals import ArrivalConfig, plan_requests  # noqa: E402
from loadgen.http_target import OpenAIStreamingTarget  # noqa: E402
from loadgen.prompts import PromptBuilder  # noqa: E402
from loadgen.replay import ReplayResult, replay  # noqa: E402
from loadgen.stats import percentile  # noqa: E402
from loadgen.traces import read_trace, shared_dir  # noqa: E402
from tests.e2e.serve_process import ServeRun, replica_pid  # noqa: E402

ROLES = ("PromptEngine", "TokenEngine", "AttentionShard")
NUM_SERVICES = 4  # deploy/local.yaml: a prompt engine, a token engine, two shards
MIGRATIONS = "ray_phasemesh_request_migrations_total"
REFUSED = "ServerError: HTTP 503"


def say(message: str) -> None:
    print(f"[chaos] {message}", file=sys.stderr, flush=True)


def trace_slice(args: argparse.Namespace) -> list[Any]:
    config = ArrivalConfig(
        duration_s=args.seconds, token_scale=float(Fraction(args.token_scale)), seed=args.seed
    )
    trace = shared_dir() / "traces" / "AzureLLMInferenceTrace_conv.csv"
    return list(plan_requests(read_trace(trace), config))


def run_replay(url: str, specs: list[Any]) -> ReplayResult:
    async def main() -> ReplayResult:
        prompts = PromptBuilder(vocab_size=2048, seed=0)  # the tiny model's vocabulary
        target = OpenAIStreamingTarget(url, "tiny", prompts=prompts, read_timeout_s=120.0)
        try:
            return await replay(specs, target, progress=False)
        finally:
            await target.aclose()

    return asyncio.run(main())


def migrations(server: ServeRun) -> float:
    """The router's migrations so far, from Ray's metrics endpoint (0 before the first)."""
    text = httpx.get(server.ray_metrics_url(), timeout=10).text
    pattern = re.compile(rf"^{MIGRATIONS}(?:{{[^}}]*}})? (\S+)$", re.MULTILINE)
    return sum(float(v) for v in pattern.findall(text))


def healthy(server: ServeRun) -> bool:
    """Every service answers /stats and a one-token request succeeds."""
    try:
        stats = httpx.get(server.base_url + "/stats", timeout=5).json()
        body = {"model": "tiny", "prompt": [11, 12, 13], "max_tokens": 1}
        ok = httpx.post(server.base_url + "/v1/completions", json=body, timeout=30).is_success
        return ok and len(stats["services"]) >= NUM_SERVICES
    except (httpx.HTTPError, ValueError, KeyError):
        return False


def killer(server: ServeRun, args: argparse.Namespace, stop: threading.Event) -> list[dict]:
    """Kill a random replica every `kill_every` s until `stop`; time each recovery."""
    rng = random.Random(args.seed)
    kills: list[dict] = []
    while not stop.wait(args.kill_every):
        role = rng.choice(ROLES)
        try:
            os.kill(replica_pid(server, role), signal.SIGKILL)
        except (LookupError, ProcessLookupError):
            continue  # that role's replica is itself restarting
        killed_at = time.monotonic()
        say(f"killed {role}")
        # NOTE: polling another process's recovery: there is nothing to block on.
        while not healthy(server) and time.monotonic() - killed_at < 120:
            time.sleep(0.5)
        kills.append({"role": role, "recovered_s": round(time.monotonic() - killed_at, 2)})
        say(f"{role} recovered in {kills[-1]['recovered_s']} s")
    return kills


def summary(result: ReplayResult) -> dict[str, Any]:
    ok = [r for r in result.records if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tbt = [gap for r in ok for gap in r.itl_s]
    ms = {
        f"{name}_p{q}_ms": round(1000 * percentile(values, q), 1) if values else None
        for name, values in (("ttft", ttft), ("tbt", tbt))
        for q in (50, 90)
    }
    failed = [r for r in result.records if not r.ok]
    # A 503 with Retry-After is a refusal at the door while no replica of a role is up (the
    # openai client retries it by itself); a request lost is one the mesh admitted and then failed.
    refused = [r for r in failed if (r.error or "").startswith(REFUSED)]
    errors = sorted({r.error or "" for r in failed if r not in refused})
    return {"requests": len(result.records), "completed": len(ok), "lost": len(failed)
            - len(refused), "refused_503": len(refused), **ms, "errors": errors[:5]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="trace slice length")
    parser.add_argument("--kill-every", type=float, default=15.0, help="seconds between kills")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--token-scale", default="1/16", help="as tests/e2e/test_loadgen_replay")
    args = parser.parse_args()
    specs = trace_slice(args)
    with tempfile.TemporaryDirectory(prefix="chaos-") as workdir:
        server = ServeRun(REPO / "deploy" / "local.yaml", Path(workdir), preset="tiny")
        say(f"starting serve run deploy/local.yaml; {len(specs)} requests per replay")
        try:
            server.start()
            say("replay 1/2: no faults")
            calm = summary(run_replay(server.base_url, specs))
            before = migrations(server)
            say(f"replay 2/2: a random replica killed every {args.kill_every:g} s")
            stop = threading.Event()
            kills: list[dict] = []
            thread = threading.Thread(target=lambda: kills.extend(killer(server, args, stop)))
            thread.start()
            chaos = summary(run_replay(server.base_url, specs))
            stop.set()
            thread.join()
            num_migrations = migrations(server) - before
        finally:
            server.stop()
    report(args, calm, chaos, kills, num_migrations)


def report(
    args: argparse.Namespace, calm: dict, chaos: dict, kills: list[dict], num_migrations: float
) -> None:
    print(f"no faults : {calm}")
    print(f"with kills: {chaos}")
    print(f"kills     : {kills}; migrations {num_migrations:g}")
    ratios = {
        f"{key}_ratio": round(chaos[key] / calm[key], 2)
        for key in ("ttft_p50_ms", "ttft_p90_ms", "tbt_p50_ms", "tbt_p90_ms")
        if chaos.get(key) and calm.get(key)
    }
    targets = {"requests_lost": 0}
    result = {
        "bench": "chaos", "seconds": args.seconds, "kill_every_s": args.kill_every,
        "seed": args.seed, "no_faults": calm, "with_kills": chaos, "kills": kills,
        "migrations": num_migrations, **ratios, "targets": targets,
        "targets_met": {"requests_lost": chaos["lost"] == 0 and bool(kills)},
    }  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
