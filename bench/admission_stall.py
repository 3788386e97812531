"""Admission stall: do requests already decoding slow down when a newcomer joins (Lamina §5)?

    python bench/admission_stall.py [--residents 4] [--newcomers 12] [--newcomer-prompt 512]

For each KV transfer (`push`: prompt engines ship KV into the shards while they decode; `pull`:
shards fetch it between decode steps, and the token engine admits the newcomer once it landed on
every shard), on the same launched mesh shape (1 prompt engine, 1 token engine, 2 shards):
`--residents` requests decode for the whole run while `--newcomers` requests join one at a time,
each with a long prompt and a few tokens, `--quiet-s` apart.

A newcomer's admission window runs from its first token (prefill done, KV shipped or held) to its
second (its first decode step on the token engine). The residents' token gaps that end inside a
window are admission gaps. The gap with no admission they are held against is the residents' gaps
ending at the newcomer's later tokens: the same batch (the newcomer in it, its long context
included) with nothing being admitted. Also printed: quiet gaps, which touch no newcomer at all.
Figures are medians over newcomers of the per-window mean (and max), at the mesh's own client;
`ratio` is the median over newcomers of each one's admission gap over its own no-admission gap.

The last line is JSON with the ratios and `targets`: pull's admission gap within 10% of the gap
with no admission. Timings on a shared 2-core machine are noisy: the load average is printed
beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.model.default import default_model_path  # noqa: E402
from common.protocol import SamplingSpec  # noqa: E402
from services.launch.local_mesh import LocalMesh, Topology  # noqa: E402
from services.launch.test_client import MeshTestClient  # noqa: E402
from tests.conftest import random_prompts  # noqa: E402

Span = tuple[float, float]
NEWCOMER = SamplingSpec(max_tokens=5, ignore_eos=True)  # 1 from prefill, then 4 decode steps


def run_arm(args: argparse.Namespace, kv_transfer: str) -> dict[str, float]:
    topology = Topology(
        str(default_model_path(args.model)), num_prompt=1, num_token=1, num_shards=2,
        num_blocks=2048, kv_transfer=kv_transfer,
    )  # fmt: skip
    mesh = LocalMesh.start(topology)
    try:
        return measure(MeshTestClient(mesh), args)
    finally:
        mesh.close()


def measure(client: MeshTestClient, args: argparse.Namespace) -> dict[str, float]:
    lengths = [args.resident_prompt] * args.residents + [args.newcomer_prompt] * args.newcomers
    prompts = random_prompts(lengths, 2048, seed=7)
    endless = SamplingSpec(max_tokens=4000, temperature=0.0, ignore_eos=True)
    for i in range(args.residents):
        client.submit(f"resident-{i}", prompts[i], endless)
    times: dict[str, list[float]] = {f"resident-{i}": [] for i in range(args.residents)}
    _receive(client, times, until=lambda: min(map(len, times.values())) >= 16)
    windows, busy = [], []
    for j in range(args.newcomers):
        req_id = f"newcomer-{j}"
        times[req_id] = []
        submitted = time.monotonic()
        client.submit(req_id, prompts[args.residents + j], NEWCOMER)
        _receive(client, times, until=lambda r=req_id: len(times[r]) >= NEWCOMER.max_tokens)  # type: ignore[misc]
        windows.append(times[req_id])
        busy.append((submitted, times[req_id][-1]))
        quiet_until = time.monotonic() + args.quiet_s
        _receive(client, times, until=lambda t=quiet_until: time.monotonic() >= t)  # type: ignore[misc]
    for i in range(args.residents):
        client.abort(f"resident-{i}")
    gaps = [(a, b) for i in range(args.residents) for a, b in _pairs(times[f"resident-{i}"])]
    return summarize(gaps, windows, busy)


def summarize(gaps: list[Span], newcomers: list[list[float]], busy: list[Span]) -> dict[str, float]:
    """`newcomers`: each newcomer's token times; see the module docstring."""
    quiet = [b - a for a, b in gaps if not any(a < e and b > s for s, e in busy)]
    means, maxes, after, ratios = [], [], [], []
    for t in newcomers:
        inside = [b - a for a, b in gaps if t[0] < b <= t[1]]
        later = [b - a for a, b in gaps if t[1] < b <= t[-1]]
        if inside and later:
            means.append(statistics.mean(inside))
            maxes.append(max(inside))
            after.append(statistics.mean(later))
            ratios.append(means[-1] / after[-1])  # each window against its own batch: load drifts
    admission_ms = 1e3 * statistics.median(means)
    no_admission_ms = 1e3 * statistics.median(after)
    return {
        "admission_gap_ms": round(admission_ms, 3),
        "admission_max_gap_ms": round(1e3 * statistics.median(maxes), 3),
        "no_admission_gap_ms": round(no_admission_ms, 3),
        "quiet_gap_ms": round(1e3 * statistics.median(quiet), 3),
        "ratio": round(statistics.median(ratios), 4),
        "num_quiet_gaps": len(quiet),
        "num_windows": len(means),
    }


def _median_arm(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: round(statistics.median(run[key] for run in runs), 4) for key in runs[0]}


def _receive(client: MeshTestClient, times: dict[str, list[float]], until) -> None:  # noqa: ANN001
    while not until():
        out = client.recv(timeout=120)
        if out.error:
            raise RuntimeError(f"{out.req_id} failed: {out.error}")
        if out.req_id in times:
            times[out.req_id] += [time.monotonic()] * len(out.token_ids)


def _pairs(stamps: list[float]) -> list[Span]:
    return [(a, b) for a, b in zip(stamps, stamps[1:], strict=False) if b > a]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--residents", type=int, default=4)
    p.add_argument("--resident-prompt", type=int, default=64)
    p.add_argument("--newcomers", type=int, default=12)
    p.add_argument("--newcomer-prompt", type=int, default=512)
    p.add_argument("--quiet-s", type=float, default=0.3)
    p.add_argument("--rounds", type=int, default=1, help="push, pull, push, pull, ...: the "
                   "figures are medians over rounds (load on a shared machine drifts)")  # fmt: skip
    return p.parse_args()


def main() -> None:
    args = parse_args()
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    rounds = [{mode: run_arm(args, mode) for mode in ("push", "pull")} for _ in range(args.rounds)]
    arms = {mode: _median_arm([r[mode] for r in rounds]) for mode in ("push", "pull")}
    for mode, arm in arms.items():
        print(f"{mode}: gap while a newcomer is admitted {arm['admission_gap_ms']} ms (max "
              f"{arm['admission_max_gap_ms']} ms), same batch with no admission "
              f"{arm['no_admission_gap_ms']} ms, ratio {arm['ratio']}; quiet gap "
              f"{arm['quiet_gap_ms']} ms")  # fmt: skip
    result = {
        "arms": arms,
        "pull_over_push_admission_gap": round(
            arms["pull"]["admission_gap_ms"] / arms["push"]["admission_gap_ms"], 4
        ),
        "loadavg_before": load_before,
        "loadavg_after": Path("/proc/loadavg").read_text().split()[:3],
        "ratios_by_round": [{m: r[m]["ratio"] for m in r} for r in rounds],
        "targets": {"pull_admission_gap_vs_no_admission": "<= 1.10"},
    }
    result["targets_met"] = {"pull_admission_gap_vs_no_admission": arms["pull"]["ratio"] <= 1.10}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
