"""The simulator against the real mesh: the same Azure slice, simulated and replayed, side by side.

    python bench/sim_validation.py [--time-scales 1 1/4] [--duration 120] [--url URL]
                                   [--server-pid PID]

1. Starts `serve run deploy/local.yaml` (the tiny model; a prompt engine, a token engine with a
   2-shard group, the router, Serve's HTTP proxy), unless `--url` names a running one.
2. Profiles it with `bench/profile.py --decode URL`: prefill batches in this process, decode steps
   through the server's HTTP API (shard round trips and token streaming included), written as a
   Splitwise-format table (`profile.csv`, hardware `cpu-local-mesh`).
3. Measures the host (`host.json`, `loadgen/sim/shared_cpu.py`) from /proc (`bench/host_cpu.py`):
   the front end's latency alone (unloaded TTFT minus the profiled prefill: its low decile and
   each request's excess over it, which the simulator draws from); the hand-off's stall
   of the token engine (unloaded gap to the second token minus a profiled step); each front-end
   loop's CPU per request and per token; the cores a prefill and a decode step at several batch
   sizes take alone; the background over the profile and these measurements: other processes' CPU,
   above the mesh's priority (nice 0 against Ray's nice 15: served first) or at it (shared);
   which front-end loops run above the mesh's priority (the client).
4. For each time scale: simulates the slice (`python -m loadgen replay --target
   sim:PhaseMesh-CPU:1P1T@host=host.json`), replays it on the server (`python -m loadgen replay
   --url`; same trace, window, token and time scales), and simulates it again with the background
   measured during the replay (other engineers' jobs come and go on a shared box).
5. Prints p50/p90 TTFT and TBT of the replay and the second simulation, their ratios, and the
   first simulation. TBT is a request's mean gap after its first token (TPOT; what the simulator
   models, as Splitwise's does); the gap-by-gap ITL is printed for information. Each check passes
   within `--tolerance` (25%). The last line is one JSON object with `targets` (each check's
   sim / real ratio within the tolerance of 1) and `targets_met` (over every time scale).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from fractions import Fraction
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# NOTE: bench/ is on the path as this script's folder; bench/profile.py takes it off when loaded
# (its name is a stdlib module's), so everything from bench/ is imported here, first.
from host_cpu import (  # noqa: E402
    BackgroundMeter,
    CpuSampler,
    process_tree,
    role_pids,
    stop_survivors,
)
from host_model import (  # noqa: E402
    HARDWARE,
    background,
    load_profile_bench,
    measure_host,
    sequential_requests,
    vocab_size,
)

from loadgen.arrivals import ArrivalConfig, plan_requests  # noqa: E402
from loadgen.sim.shared_cpu import HostModel  # noqa: E402
from loadgen.traces import read_trace, shared_dir  # noqa: E402

CHECKS = ("p50_ttft_ms", "p90_ttft_ms", "p50_tpot_ms", "p90_tpot_ms")


# ---- the two replays ----


def replay_command(args: argparse.Namespace, time_scale: str, out_dir: Path) -> list[str]:
    return [
        sys.executable, "-m", "loadgen", "replay", "--trace", args.trace,
        "--start", str(args.start), "--duration", str(args.duration),
        "--time-scale", time_scale, "--token-scale", args.token_scale,
        "--out", str(out_dir), "--no-plots", "--disable-tqdm",
    ]  # fmt: skip


def run_loadgen(
    command: list[str], env: dict[str, str] | None = None, sampler: CpuSampler | None = None
) -> dict[str, Any]:
    """Run `python -m loadgen replay ...`; its last stdout line (the results JSON)."""
    proc = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    if sampler is not None:
        sampler.extra_client_pid = proc.pid
    stdout, stderr = proc.communicate(timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command[2:5])} exited {proc.returncode}:\n{stderr[-3000:]}")
    return dict(json.loads(stdout.strip().splitlines()[-1]))


def simulate(
    args: argparse.Namespace, scale: str, profile_csv: Path, host: Path, tag: str
) -> dict[str, Any]:
    env = dict(os.environ, PHASEMESH_PERF_PROFILE=str(profile_csv))
    target = f"sim:PhaseMesh-CPU:1P1T@host={host}"
    command = replay_command(args, scale, args.out / f"sim-{tag}-{scale.replace('/', '_')}")
    return run_loadgen(command + ["--target", target], env)


def replay_real(args: argparse.Namespace, scale: str, url: str) -> tuple[dict[str, Any], dict]:
    command = replay_command(args, scale, args.out / f"real-{scale.replace('/', '_')}")
    command += ["--url", url, "--vocab-size", str(vocab_size())]
    pids = role_pids(args.server_pid)
    meter = BackgroundMeter()
    with CpuSampler(pids, interval_s=0.1) as sampler:
        start = time.monotonic()
        summary = run_loadgen(command, sampler=sampler)
    cores = sampler.cores(start, time.monotonic())
    above, shared = background(meter, pids, sampler.extra_client_pid or 0)
    cores |= {"background_above": above, "background_shared": shared}
    return summary, {k: round(v, 3) for k, v in cores.items()}


# ---- comparison ----


def compare(sim: dict[str, Any], real: dict[str, Any], tolerance: float) -> dict[str, Any]:
    keys = CHECKS + ("p50_itl_ms", "p90_itl_ms")
    ratio = {k: round(sim[k] / real[k], 3) for k in keys}
    ok = {k: abs(ratio[k] - 1.0) <= tolerance for k in CHECKS}
    return {
        "sim": {k: round(sim[k], 2) for k in keys},
        "real": {k: round(real[k], 2) for k in keys},
        "ratio": ratio,
        "ok": ok,
        "pass": all(ok.values()),
        "completed": {"sim": sim["completed"], "real": real["completed"]},
    }


LABELS = {
    "p50_ttft_ms": "TTFT p50", "p90_ttft_ms": "TTFT p90", "p50_tpot_ms": "TBT p50 (mean gap)",
    "p90_tpot_ms": "TBT p90 (mean gap)", "p50_itl_ms": "ITL p50 (each gap)",
    "p90_itl_ms": "ITL p90 (each gap)",
}  # fmt: skip


def print_comparison(scale: str, result: dict[str, Any], tolerance: float) -> None:
    (above, shared), (above0, shared0) = (
        result["background_cores"]["during"],
        result["background_cores"]["before"],
    )
    print(
        f"time scale {scale}: {result['completed']['real']} requests; background cores above / "
        f"at the mesh's priority {above:.2f} / {shared:.2f} during the replay "
        f"({above0:.2f} / {shared0:.2f} measured before)"
    )
    print(f"  {'ms':<20}{'sim':>9}{'real':>9}{'sim/real':>10}{'sim, bg before':>16}")
    for key, label in LABELS.items():
        mark = ("ok" if result["ok"][key] else "FAIL") if key in result["ok"] else "(info)"
        sim, real, ratio = result["sim"][key], result["real"][key], result["ratio"][key]
        before = result["sim_background_before"][key]
        print(f"  {label:<20}{sim:9.1f}{real:9.1f}{ratio:10.2f}{before:16.1f}  {mark}")
    verdict = "PASS" if result["pass"] else "FAIL"
    print(f"  {verdict}: every check within {tolerance:.0%}")


# ---- main ----


def slice_sizes(args: argparse.Namespace, count: int) -> list[int]:
    """`count` prompt sizes spread over the slice, for the front-end probe."""
    config = ArrivalConfig(
        start_s=args.start, duration_s=args.duration, token_scale=float(Fraction(args.token_scale))
    )
    sizes = [spec.input_len for spec in plan_requests(read_trace(args.trace), config)]
    return sizes[:: max(len(sizes) // count, 1)][:count]


def measure(args: argparse.Namespace, url: str) -> tuple[Path, Path, float]:
    profile_csv, host_json = args.out / "profile.csv", args.out / "host.json"
    sequential_requests(url, [16, 64, 128, 256], gap_s=0.2)  # warm-up: first-call costs
    meter = BackgroundMeter()
    if args.profile:
        profile_csv = args.profile
    else:
        # NOTE: at most 2048 prompt tokens a cell: its decode runs its join allowance past
        # them, doubled until the batch decodes together, and a batch that outgrows the token
        # engine's 8192 KV tokens (deploy/local.yaml) never does.
        load_profile_bench().main(
            ["--decode", url, "--hardware", HARDWARE, "--repeats", str(args.repeats),
             "--prompt-sizes", *map(str, args.prompt_sizes), "--max-batch-tokens", "2048",
             *(["--batch-sizes", *map(str, args.batch_sizes)] if args.batch_sizes else []),
             "--out", str(profile_csv)]
        )  # fmt: skip
    host, idle_mesh = measure_host(
        url, args.server_pid, profile_csv, slice_sizes(args, args.probe_requests), meter,
        args.idle_s, args.decode_batches,
    )  # fmt: skip
    host.save(host_json)
    print("host:", json.dumps(host.to_dict()))
    return profile_csv, host_json, idle_mesh


def with_background(host_json: Path, above: float, shared: float, out: Path) -> Path:
    """A copy of the host model with another background load (profiled under the first)."""
    host = HostModel.load(host_json)
    cpu = replace(
        host.cpu,
        background_cores=round(above, 3),
        shared_background_cores=round(shared, 3),
        profiled_background_cores=host.cpu.background_cores,
        profiled_shared_background_cores=host.cpu.shared_background_cores,
    )
    replace(host, cpu=cpu).save(out)
    return out


def validate_scale(
    args: argparse.Namespace, scale: str, url: str, measured: tuple[Path, Path, float]
) -> dict[str, Any]:
    """Simulate the slice with the background measured before the replay (a prediction), replay
    it, and simulate it again with the background the replay saw (other engineers' jobs on a
    shared box come and go): the second is the one compared."""
    profile_csv, host_json, idle_mesh = measured
    predicted = simulate(args, scale, profile_csv, host_json, "before")
    real, cores = replay_real(args, scale, url)
    above, shared = cores["background_above"], cores["background_shared"] + idle_mesh
    during = with_background(
        host_json, above, shared, args.out / f"host-{scale.replace('/', '_')}.json"
    )
    sim = simulate(args, scale, profile_csv, during, "during")
    result = compare(sim, real, args.tolerance)
    cpu = HostModel.load(host_json).cpu
    result["background_cores"] = {
        "before": [cpu.background_cores, cpu.shared_background_cores],
        "during": [round(above, 3), round(shared, 3)],
    }
    result["sim_background_before"] = {k: round(predicted[k], 2) for k in result["sim"]}
    result["cores_during_replay"] = cores
    return result


def validate(args: argparse.Namespace, url: str) -> dict[str, Any]:
    measured = measure(args, url)
    profile_csv, host_json, _ = measured
    results: dict[str, Any] = {}
    for scale in args.time_scales:
        results[scale] = validate_scale(args, scale, url, measured)
        print_comparison(scale, results[scale], args.tolerance)
    targets = {key: f"sim / real within {args.tolerance:.0%} of 1" for key in CHECKS}
    met = {key: all(r["ok"][key] for r in results.values()) for key in CHECKS}
    return {
        "trace": Path(args.trace).name,
        "window_s": [args.start, args.start + args.duration],
        "token_scale": args.token_scale,
        "tolerance": args.tolerance,
        "profile": str(profile_csv),
        "host": HostModel.load(host_json).to_dict(),
        "time_scales": results,
        "pass": all(r["pass"] for r in results.values()),
        "targets": targets,
        "targets_met": met,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    trace = shared_dir() / "traces" / "AzureLLMInferenceTrace_conv.csv"
    parser.add_argument("--trace", default=str(trace))
    parser.add_argument("--start", type=float, default=0.0, help="window start (trace s)")
    parser.add_argument("--duration", type=float, default=120.0, help="window length (trace s)")
    parser.add_argument("--token-scale", default="1/16", help="as tests/e2e/test_loadgen_replay")
    parser.add_argument("--time-scales", nargs="+", default=["1"], help="replay speeds")
    parser.add_argument("--tolerance", type=float, default=0.25)
    parser.add_argument("--repeats", type=int, default=2, help="profile repeats")
    parser.add_argument("--prompt-sizes", type=int, nargs="+", default=[16, 64, 256],
                        help="the profile's prompt sizes")  # fmt: skip
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                        help="the profile's batch sizes (default: bench/profile.py's)")  # fmt: skip
    parser.add_argument("--probe-requests", type=int, default=24,
                        help="requests sent one by one to time the front end alone")  # fmt: skip
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 4, 16, 48])
    parser.add_argument("--idle-s", type=float, default=5.0, help="background measurement")
    parser.add_argument("--url", default=None, help="a running server (default: serve run)")
    parser.add_argument("--server-pid", type=int, default=None,
                        help="with --url: its `serve run` process, where other meshes run on the "
                        "machine (default: the only mesh on it)")  # fmt: skip
    parser.add_argument("--profile", type=Path, default=None, help="reuse this profile table")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "sim_validation")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.url:
        result = validate(args, args.url)
    else:
        from tests.e2e.serve_process import ServeRun

        run = ServeRun(REPO / "deploy" / "local.yaml", args.out, preset="tiny")
        started = time.monotonic()
        run.start()
        args.server_pid = run.pid
        print(f"serve run deploy/local.yaml: up in {time.monotonic() - started:.0f} s")
        try:
            result = validate(args, run.base_url)
        finally:
            tree = process_tree(run.pid) if run.pid else set()
            run.stop()
            stop_survivors(tree)
    # NOTE: kept with the run: the per-role cores during the replay are what a model check needs.
    (args.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
