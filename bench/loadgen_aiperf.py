"""loadgen and NVIDIA's AIPerf on the same slice: do the two clients measure the same latencies?

    python bench/loadgen_aiperf.py --url http://127.0.0.1:8000 --tokenizer MODEL_FOLDER
        [--aiperf PATH] [--num-requests 24] [--concurrency 2] [--input-len 64] [--output-len 16]
        [--rounds 2]

Against one running server (`make run`, or any OpenAI-compatible one), one tool after the other
(`--rounds` times, alternating, so a machine whose load drifts weighs on both alike), each sends
`--num-requests` streamed chat requests, `--concurrency` at a time (closed loop), after
`--concurrency` warm-up requests: prompts of `--input-len` tokens of message text (loadgen adds
the chat template's own tokens to its length, as AIPerf's text goes inside that template too) and
exactly `--output-len` output tokens (`ignore_eos`, `min_tokens`). The model is the first of
`/v1/models`; `--tokenizer` is its tokenizer (a folder with `tokenizer.json`), which both need.

Figures: TTFT p50/p90 and E2E p50 by each tool (the median over rounds; each round's too) and the
ratio loadgen / AIPerf. Target: every ratio within a third of 1. NOTE: both tools share the
machine with the server; on a small CPU box AIPerf's own processes (several, over ZeroMQ) take
cores the server would use, which shows as longer latencies in its rounds. AIPerf runs with one
worker, one record processor and no UI (its least), and each tool's CPU seconds (its process and
every child it waited for) are figures too: a tool that takes the server's cores shows there.

AIPerf is `--aiperf`, else `$PHASEMESH_AIPERF`, else `aiperf` on PATH (install it in its own
virtual environment: it pins many packages); without it the last line says `skipped` and why.
The last line is one JSON object with `targets` and `targets_met`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[0] = str(REPO)  # NOTE: not bench/, whose profile.py would shadow the stdlib's

from common.config import env  # noqa: E402
from loadgen.commands import wait_for_model  # noqa: E402
from loadgen.text_prompts import text_prompt_builder  # noqa: E402

AGREEMENT = 1 / 3  # |loadgen / AIPerf - 1| at most this
# (figure name, loadgen's results.json key, AIPerf's metric and statistic)
METRICS = (
    ("ttft_p50", "p50_ttft_ms", "time_to_first_token", "p50"),
    ("ttft_p90", "p90_ttft_ms", "time_to_first_token", "p90"),
    ("e2e_p50", "p50_e2el_ms", "request_latency", "p50"),
)
TARGETS = {f"{name}_ratio_within": AGREEMENT for name, *_ in METRICS}


@dataclass(frozen=True)
class Slice:
    """The workload both tools send."""

    num_requests: int = 24
    concurrency: int = 2
    input_len: int = 64
    output_len: int = 16
    seed: int = 0


def find_aiperf(explicit: str | None = None) -> str | None:
    """The AIPerf executable: `explicit`, `$PHASEMESH_AIPERF`, or `aiperf` on PATH."""
    for candidate in (explicit, env("AIPERF"), shutil.which("aiperf")):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def children_cpu_s() -> float:
    """CPU seconds of this process's finished children (and theirs, where they waited for them)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed_run(command: list[str], cwd: Path) -> float:
    """Run `command` to its end; the CPU seconds it took. A non-zero exit raises with the end of
    what it printed."""
    before = children_cpu_s()
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        printed = (done.stdout + done.stderr)[-4000:]
        raise RuntimeError(f"{Path(command[0]).name} exited {done.returncode}:\n{printed}")
    return children_cpu_s() - before


def run_loadgen(url: str, tokenizer: str, work: Slice, out_dir: Path) -> dict[str, Any]:
    """`python -m loadgen replay` on the slice; its results.json, with the client's `cpu_s`."""
    template_len = text_prompt_builder(tokenizer, work.seed, chat=True).num_added
    command = [
        sys.executable, "-m", "loadgen", "replay", "--url", url, "--endpoint", "chat",
        "--tokenizer", tokenizer, "--dataset-name", "random",
        "--random-input-len", str(work.input_len + template_len),
        "--random-output-len", str(work.output_len), "--num-requests", str(work.num_requests),
        "--request-rate", "inf", "--max-concurrency", str(work.concurrency),
        "--warmup", str(work.concurrency), "--seed", str(work.seed), "--out", str(out_dir),
        "--no-plots", "--disable-tqdm",
    ]  # fmt: skip
    cpu_s = timed_run(command, REPO)
    results: dict[str, Any] = json.loads((out_dir / "results.json").read_text())
    return results | {"cpu_s": cpu_s}


def run_aiperf(
    aiperf: str, url: str, model: str, tokenizer: str, work: Slice, out_dir: Path
) -> dict[str, Any]:
    """`aiperf profile` on the slice; its profile_export_aiperf.json, with the client's `cpu_s`."""
    command = [
        aiperf, "profile", "--model", model, "--url", url, "--endpoint-type", "chat",
        "--streaming", "--tokenizer", tokenizer, "--concurrency", str(work.concurrency),
        "--request-count", str(work.num_requests),
        "--warmup-request-count", str(work.concurrency),
        "--prompt-input-tokens-mean", str(work.input_len), "--prompt-input-tokens-stddev", "0",
        "--prompt-output-tokens-mean", str(work.output_len),
        "--prompt-output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true",
        "--extra-inputs", f"min_tokens:{work.output_len}", "--random-seed", str(work.seed),
        "--output-artifact-dir", str(out_dir), "--no-server-metrics", "--no-gpu-telemetry",
        "--workers-max", "1", "--record-processors", "1", "--ui-type", "none",
    ]  # fmt: skip
    cpu_s = timed_run(command, out_dir.parent)
    export: dict[str, Any] = json.loads((out_dir / "profile_export_aiperf.json").read_text())
    return export | {"cpu_s": cpu_s}


def agreement(loadgen: list[dict[str, Any]], aiperf: list[dict[str, Any]]) -> dict[str, Any]:
    """Each tool's figures (median over its rounds), their ratios, and whether each ratio is
    within `AGREEMENT` of 1."""
    figures: dict[str, Any] = {}
    met: dict[str, bool] = {}
    for name, loadgen_key, metric, stat in METRICS:
        our_rounds = [float(run[loadgen_key]) for run in loadgen]
        their_rounds = [float(run[metric][stat]) for run in aiperf]
        ours, theirs = statistics.median(our_rounds), statistics.median(their_rounds)
        ratio = ours / theirs if theirs > 0 else float("inf")
        figures |= {f"loadgen_{name}_ms": ours, f"aiperf_{name}_ms": theirs, f"{name}_ratio": ratio}
        if len(loadgen) > 1:
            figures |= {f"loadgen_{name}_rounds_ms": our_rounds,
                        f"aiperf_{name}_rounds_ms": their_rounds}  # fmt: skip
        met[f"{name}_ratio_within"] = abs(ratio - 1) <= AGREEMENT
    for tool, runs in (("loadgen", loadgen), ("aiperf", aiperf)):
        figures[f"{tool}_cpu_s"] = statistics.median(run["cpu_s"] for run in runs)
    figures["loadgen_completed"] = sum(run["completed"] for run in loadgen)
    figures["aiperf_completed"] = sum(int(run["request_count"]["avg"]) for run in aiperf)
    return figures | {"targets": TARGETS, "targets_met": met}


def compare(
    url: str, tokenizer: str, aiperf: str, work: Slice, workdir: Path, rounds: int = 1
) -> dict[str, Any]:
    """Run both tools on `work` against `url`, alternating `rounds` times, and compare them."""
    model = asyncio.run(wait_for_model(url, {}, timeout_s=120.0)).name
    ours, theirs = [], []
    for index in range(rounds):
        ours.append(run_loadgen(url, tokenizer, work, workdir / f"loadgen{index}"))
        theirs.append(run_aiperf(aiperf, url, model, tokenizer, work, workdir / f"aiperf{index}"))
    return {"url": url, "model": model, "slice": vars(work)} | agreement(ours, theirs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--tokenizer", required=True, help="the served model's folder")
    parser.add_argument("--aiperf", default=None, help="the aiperf executable")
    parser.add_argument("--num-requests", type=int, default=Slice.num_requests)
    parser.add_argument("--concurrency", type=int, default=Slice.concurrency)
    parser.add_argument("--input-len", type=int, default=Slice.input_len)
    parser.add_argument("--output-len", type=int, default=Slice.output_len)
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs of each tool")
    args = parser.parse_args()
    aiperf = find_aiperf(args.aiperf)
    if aiperf is None:
        reason = "aiperf not found (--aiperf, $PHASEMESH_AIPERF or PATH)"
        print(json.dumps({"skipped": reason, "targets": TARGETS, "targets_met": {}}))
        return
    work = Slice(args.num_requests, args.concurrency, args.input_len, args.output_len)
    with tempfile.TemporaryDirectory() as workdir:
        url = args.url.rstrip("/")
        result = compare(url, args.tokenizer, aiperf, work, Path(workdir), args.rounds)
    for key, value in result.items():
        if isinstance(value, float) and key.endswith(("_ms", "_ratio", "_cpu_s")):
            print(f"{key:<24}{value:.3f}" if key.endswith("_ratio") else f"{key:<24}{value:.1f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
