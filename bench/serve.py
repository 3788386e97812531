"""The served path against the in-process engine, in one run: what the front end costs.

    python bench/serve.py [--preset tiny|small] [--quick] [--batches 1 8 32] [--tokens 256]
                          [--paths inprocess neighbor client local engine_beside_served mesh
                                   mesh_processes mesh_processes_beside_served ceiling]
                          [--stream-interval 8] [--ingress direct proxy] [--ceiling-speedup 1 4]
                          [--neighbor-cores 0.1 0.2 0.3 0.5 0.7]
                          [--worker-niceness 0] [--modes stream plain]
                          [--mesh-args '{"token_engine_threads": 1}']

For each batch size, `batch` requests are sent together (greedy, `ignore_eos`, `--tokens` new
tokens each, the same prompts on every path) to:
- `inprocess`: one `LLMEngine` in this process (`bench/engine.py`'s engine, no front end);
- `neighbor`: the in-process engine again, beside `--neighbor-cores` cores of synthetic load
  each (`bench/cpu_load.py`: processes burning CPU in 300 us bursts), as
  `inprocess_beside_<cores>`: what others' CPU alone costs an engine on this machine;
- `client`: the Router's `InProcessEngineClient` in this process (engine on its own thread,
  outputs to this event loop; no HTTP, no Ray): the front end's threading alone, beside the
  served paths that add uvicorn, the Router and Ray's runtime on the same cores;
- `local`: `serve run deploy/single.yaml` (`topology: local`: the engine inside the Router
  replica), over HTTP with the official `openai` streaming client;
- `engine_beside_served`: the `inprocess` engine again, run while the served `local` (the first
  `--ingress`) is still up and idle, after its batches: its `ratio` is what Ray's runtime and the
  idle replica beside it cost an engine that serves nothing through them, and
  `local_<ingress>[_plain]_over_engine_beside_served` what serving through them adds;
- `mesh`: `serve run deploy/local.yaml` (a prompt engine, a token engine, 2 attention shards),
  over HTTP the same way; `--mesh-args` (JSON) changes its `mesh:` args, e.g. to compare a
  setting against the file's in two runs;
- `mesh_processes`: the same mesh (deploy/local.yaml's `mesh:` args, `--mesh-args` too) as
  plain OS processes without Ray (`services.launch.LocalMesh`, unpinned), plain requests through
  the Router's own `MeshEngineClient` in a process of its own: no Ray runtime, Serve or HTTP on
  the cores; `mesh_direct_plain_over_processes` is the served mesh's tok/s over it per batch;
- `mesh_processes_beside_served`: the `mesh_processes` path again, run while the served `mesh`
  (the first `--ingress`) is still up and idle, after its batches: Ray's runtime, Serve and the
  idle replicas on the same cores, no request through them. Against `mesh_processes` it is what
  their presence alone costs the mesh's processes (`mesh_processes_beside_served_over_alone`);
  against the served `mesh`, what serving through them adds
  (`mesh_direct_plain_over_beside_served`);
- `ceiling`: the front end alone (`bench/null_engine.py`): the real Router and HTTP path over
  `NullEngineFake`, an engine of no compute that offers the in-process engine's tok/s at each
  batch (times each `--ceiling-speedup`), as `ceiling_<ingress>[_x<speedup>]`. Its ratio is the
  most any engine could get served on this machine: `ceiling_local_ratio_reachable` says whether
  the local target is within reach here at all.
Each served path runs behind each `--ingress`: `direct` (Serve's direct ingress, what `make run`
starts: the Router replica serves HTTP itself), `proxy` (Serve's HTTP proxy actor, every chunk
through Ray) and, if asked, `direct_thread` (direct, the app on Serve's user-code thread instead
of the replica's event loop: tests/e2e/serve_process.py), reported as `<path>_<ingress>`, with
`<path>_direct_over_proxy` the tok/s ratio of the two. The local engine decodes on as many torch
threads as the in-process one (`engine.num_threads`), so that the two compare like with like.
With `--stream-interval N` each served path runs again with `stream_interval: N` (N tokens per
chunk, the first at once), reported as `<path>_<ingress>_si<N>`.
Each batch goes as streamed requests and, in the same server, as plain (non-streaming) ones
(`--modes`; the plain ones are reported as `<name>_plain`, with their latency p50/p90: what a
batch client sees; the table of issue 20 was measured that way).
Every path's figures are its best of 3 runs of each batch, after a warm-up batch of 2: the
in-process engine's, the client's and the served paths' alike (a served path's first run, which
also pays for its engine's first GEMMs of each new shape, is `first_run_tok_s`).
Served paths report tok/s, TTFT and the gaps between streamed chunks (TBT; a chunk carries every
token that reached the router together) p50/p90, and the Router replica process's CPU seconds (its
user+system time before and after each batch, less the threads of a local engine: the engine's is
`engine_cpu_ms_per_token`, with `engine_preemptions_per_s`: how often its threads were preempted)
per streamed token and per request (and its CPU with no request in flight, per second, which those
include, beside `server_idle_box_cores`: the whole machine's busy cores meanwhile), what
everything but the engine's threads took meanwhile, in cores (`others_cores`: the client, Ray,
the Router's own threads, its front end included; `client_cores`: the client's share, this
process's) and, with the `neighbor` path,
`ratio_bound`: the in-process engine's ratio beside that much synthetic load (interpolated), what
the served engine would reach if the others' CPU were all it cost (what is left below it: the
replica's own process, its GIL and caches, beside the engine; `bound_local_ratio_reachable[_plain]`
says per batch whether that bound passes the local target at all), Serve's HTTP proxy's CPU per
token, and the chunks each request got. The in-process engine reports the same two
(`inprocess.<batch>`), and `local_<ingress>[_plain]_engine_cpu_over_inprocess` is the served
engine's CPU per token over it. Ratios are served / in-process tok/s of the same run: the
in-process engine runs before the served paths and again after them, and `ratio` is against the
better of the two (`inprocess_tok_s_best`; the ceiling is paced by the first). Ray starts its
workers (replicas, proxy) at nice 15: on a shared machine every other process, this bench's own
clients and in-process engine included, would preempt the served path, so `--worker-niceness`
(default 0, recorded in the JSON) serves at the in-process engine's priority. `targets_met` is
judged on direct ingress (what users run), `targets_met_proxy` on the proxy, each for streamed
requests and, as `..._plain`, for plain ones. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[0] = str(REPO)  # NOTE: not bench/, whose profile.py would shadow the stdlib's

from bench.serve_engine import (  # noqa: E402
    ENGINE_ARGS,
    engine_client,
    in_fresh_process,
    in_process,
    mesh_processes_apart,
    neighbor,
)
from bench.serve_report import (  # noqa: E402
    TARGETS,
    engine_efficiency,
    judge,
    neighbor_bounds,
    rate_ratios,
    record,
    served_over_baselines,
)
from bench.serve_server import served  # noqa: E402
from common.gc_heap import freeze_startup_heap  # noqa: E402
from common.mesh_options import mesh_options  # noqa: E402

PATHS = ["inprocess", "neighbor", "client", "local", "engine_beside_served", "mesh",
         "mesh_processes", "mesh_processes_beside_served", "ceiling"]  # fmt: skip
# A path run while a served one is up and idle, and the served path it needs.
BESIDE_SERVED = {"engine_beside_served": "local", "mesh_processes_beside_served": "mesh"}
NEIGHBOR_CORES = [0.1, 0.2, 0.3, 0.5, 0.7]  # the others took 0.2 (plain) to 0.7 (streamed) here


def ceiling(
    args: argparse.Namespace, engine_tok_s: dict[int, float], batches: list[int], tokens: int
) -> dict[str, Any]:
    """The front end alone: `bench/null_engine.py`'s `NullEngineFake` (no compute) offering the
    in-process engine's tok/s (and `--ceiling-speedup` times it) through the real Router and
    HTTP path. Below 0.85 at speedup 1, the served target is out of this machine's reach."""
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as workdir:
        config = yaml.safe_load((REPO / "deploy" / "single.yaml").read_text())
        config["applications"][0]["import_path"] = "bench.null_engine:build_app"
        config["applications"][0]["args"] = {}
        source = Path(workdir) / "null_engine.yaml"
        source.write_text(yaml.safe_dump(config, sort_keys=False))
        for speedup in args.ceiling_speedup:
            app_args = {"model": args.preset, "served_model_name": args.preset,
                        "rates_tok_s": engine_tok_s, "speedup": speedup}  # fmt: skip
            for ingress in args.ingress:
                name = f"ceiling_{ingress}" + ("" if speedup == 1 else f"_x{speedup:g}")
                by_mode = served(source, app_args, args.preset, batches, tokens, ingress,
                                 tuple(args.modes))  # fmt: skip
                record(results, name, by_mode, engine_tok_s)
    return results


def yaml_mesh_args() -> dict[str, Any]:
    """deploy/local.yaml's `mesh:` args (a served config's args are replaced key by key)."""
    config = yaml.safe_load((REPO / "deploy" / "local.yaml").read_text())
    return dict(config["applications"][0]["args"]["mesh"])


def mesh_args(args: argparse.Namespace) -> dict[str, Any]:
    """The mesh args of this run: deploy/local.yaml's, changed by `--mesh-args`."""
    return yaml_mesh_args() | args.mesh_args


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--quick", action="store_true", help="batches 1 and 8, 64 tokens")
    parser.add_argument("--batches", type=int, nargs="+", default=None)
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--paths", nargs="+", default=PATHS, choices=PATHS)
    parser.add_argument(
        "--ceiling-speedup",
        type=float,
        nargs="+",
        default=[1.0, 4.0],
        help="the ceiling path: offered tok/s over the in-process engine's",
    )
    parser.add_argument(
        "--worker-niceness", type=int, default=0, help="Ray workers' nice (Ray's own default: 15)"
    )
    parser.add_argument("--ingress", nargs="+", default=["direct", "proxy"],
                        choices=["direct", "direct_thread", "proxy"])  # fmt: skip
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=None,
        help="also run the served paths with this many tokens per chunk",
    )
    parser.add_argument("--modes", nargs="+", default=["stream", "plain"],
                        choices=["stream", "plain"],
                        help="streamed requests, and/or plain (non-streaming) ones")  # fmt: skip
    parser.add_argument("--neighbor-cores", type=float, nargs="+", default=NEIGHBOR_CORES,
                        help="the neighbor path: the in-process engine beside this many cores "
                             "of synthetic load (bench/cpu_load.py), each")  # fmt: skip
    parser.add_argument("--mesh-args", type=json.loads, default={},
                        help="JSON: deploy/local.yaml's mesh args to change")  # fmt: skip
    args = parser.parse_args()
    for path, served_path in BESIDE_SERVED.items():
        if path in args.paths and served_path not in args.paths:
            parser.error(f"--paths {path} runs beside the served {served_path}: add {served_path}")
    try:  # here, not after minutes of benching and a server that never comes up
        if not isinstance(args.mesh_args, dict):
            raise ValueError("a JSON object of mesh args")
        mesh_options(mesh_args(args))
    except ValueError as exc:
        parser.error(f"--mesh-args: {exc}")
    return args


def main() -> None:
    args = parse_args()
    batches = args.batches or ([1, 8] if args.quick else [1, 8, 32])
    tokens = args.tokens or (64 if args.quick else 256)
    threads = torch.get_num_threads()  # the in-process engine's; the local one gets as many
    os.environ["RAY_worker_niceness"] = str(args.worker_niceness)  # `serve run` passes it to Ray
    # What Ray sets for a Router of `num_cpus: <threads>` (deploy/single.yaml's advice when the
    # local engine decodes on more than one thread); Ray's replicas keep a value they inherit.
    os.environ["OMP_NUM_THREADS"] = str(threads)
    print(f"preset {args.preset}, batches {batches}, {tokens} tokens, {threads} torch threads, "
          f"load {os.getloadavg()}")  # fmt: skip
    # The client's own full collections (torch and ~300,000 objects here: 164 ms one) would land
    # in the served figures; Serve freezes its replicas' heaps likewise (common/gc_heap.py).
    freeze_startup_heap()
    app_args = {"model": args.preset, "served_model_name": args.preset}
    results: dict[str, Any] = {"preset": args.preset, "tokens": tokens, "torch_threads": threads,
                               "stream_interval": args.stream_interval,
                               "worker_niceness": args.worker_niceness,
                               "served_omp_num_threads": threads,
                               "mesh_args": args.mesh_args,
                               "load_avg_start": os.getloadavg()}  # fmt: skip
    engine = in_process(args.preset, batches, tokens) if "inprocess" in args.paths else {}
    results["inprocess"] = engine
    engine_tok_s = results["inprocess_tok_s"] = {b: f["tok_s"] for b, f in engine.items()}
    if "neighbor" in args.paths and engine_tok_s:
        results.update(neighbor(args.preset, batches, tokens, engine_tok_s, args.neighbor_cores))
    if "client" in args.paths:
        # In a fresh process, as in a replica: this one's main thread has run the in-process
        # engine, and a second OpenMP team would slow the client's engine thread (its class's
        # docstring), which no server has.
        by_mode = in_fresh_process(engine_client, args.preset, batches, tokens, args.modes,
                                   threads)  # fmt: skip
        record(results, "client", by_mode, engine_tok_s)
    if "mesh_processes" in args.paths:
        by_mode = mesh_processes_apart(args.preset, batches, tokens, mesh_args(args))
        record(results, "mesh_processes", by_mode, engine_tok_s)
    results.update(serve_paths(args, app_args, engine_tok_s, batches, tokens, threads))
    results.update(served_over_baselines(results))
    if "ceiling" in args.paths and engine_tok_s:
        results.update(ceiling(args, engine_tok_s, batches, tokens))
    if engine_tok_s:  # again: a shared machine's load moves while the servers run
        end = results["inprocess_end"] = in_process(args.preset, batches, tokens)
        results["inprocess_tok_s_end"] = {b: f["tok_s"] for b, f in end.items()}
        best = {b: max(r, results["inprocess_tok_s_end"][b]) for b, r in engine_tok_s.items()}
        results["inprocess_tok_s_best"] = best
        rate_ratios(results, best)
        neighbor_bounds(results)
        print(f"  inprocess tok/s: start {engine_tok_s}, end {results['inprocess_tok_s_end']}")
    results["load_avg_end"] = os.getloadavg()
    results.update(engine_efficiency(results))
    results["targets"] = TARGETS
    judge(results, args)
    print(json.dumps(results))


def beside_served(
    args: argparse.Namespace,
    served_path: str,
    results: dict[str, Any],
    engine_tok_s: dict[int, float],
    batches: list[int],
    tokens: int,
) -> Callable[[], None] | None:
    """The path of `BESIDE_SERVED` to run while `served_path` is up and idle, as a call that
    records into `results` (its ratios come with every other's, `rate_ratios`); None when none
    was asked for."""
    path = next((p for p, s in BESIDE_SERVED.items() if s == served_path and p in args.paths), None)
    if path == "engine_beside_served":

        def engine() -> None:
            figures = results[path] = in_process(args.preset, batches, tokens)
            print(f"  {path}: " + ", ".join(f"batch {b} tok_s {f['tok_s']:.3g}"
                                            for b, f in figures.items()))  # fmt: skip

        return engine
    if path == "mesh_processes_beside_served":

        def processes() -> None:
            by_mode = mesh_processes_apart(args.preset, batches, tokens, mesh_args(args))
            record(results, path, by_mode, engine_tok_s)

        return processes
    return None


def serve_paths(
    args: argparse.Namespace,
    app_args: dict[str, Any],
    engine_tok_s: dict[int, float],
    batches: list[int],
    tokens: int,
    threads: int,
) -> dict[str, Any]:
    """`local` and `mesh` behind each ingress, at each stream interval (plain requests at the
    first only: an interval changes nothing for them)."""
    results: dict[str, Any] = {}
    intervals = [1] + ([args.stream_interval] if args.stream_interval else [])
    for interval in intervals:
        suffix = "" if interval == 1 else f"_si{interval}"
        modes = tuple(args.modes) if interval == 1 else ("stream",)
        for path, config, extra in (
            ("local", "single.yaml", {"engine": ENGINE_ARGS | {"num_threads": threads}}),
            ("mesh", "local.yaml", {"mesh": mesh_args(args)}),
        ):
            if path not in args.paths:
                continue
            config_args = app_args | extra | {"stream_interval": interval}
            for ingress in args.ingress:
                beside = None
                if interval == 1 and ingress == args.ingress[0]:
                    beside = beside_served(args, path, results, engine_tok_s, batches, tokens)
                by_mode = served(REPO / "deploy" / config, config_args, args.preset, batches,
                                 tokens, ingress, modes, while_up=beside)  # fmt: skip
                record(results, f"{path}_{ingress}{suffix}", by_mode, engine_tok_s)
            if {"direct", "proxy"} <= set(args.ingress):  # side by side, same run
                for mode_suffix in ("", "_plain") if interval == 1 else ("",):
                    direct = results.get(f"{path}_direct{suffix}{mode_suffix}")
                    proxy = results.get(f"{path}_proxy{suffix}{mode_suffix}")
                    if direct and proxy:
                        results[f"{path}_direct_over_proxy{suffix}{mode_suffix}"] = {
                            b: direct[b]["tok_s"] / proxy[b]["tok_s"] for b in batches
                        }
    return results


if __name__ == "__main__":
    main()
