"""Where a CPU engine replica's start-up goes, and what the weight cache takes off it.

Each start is a fresh interpreter (as a replica is a fresh process): the interpreter's own
start (launch to its first line), imports (torch, the extension, the model code), `load_model`
(read the checkpoint, fuse, lay out, pack; or map the weight cache's file), the KV cache's
allocation, and a first prefill (the warm-up every engine pays on its first request). A start
without the cache then times `load_model`'s pieces again (`read_s`, `fuse_s`, `layout_s`,
`pack_s`: the checkpoint's pages cached by then). Three kinds of start per model, side by side,
`--repeats` rounds in turn: `off` (no cache: what every replica paid before), `cold` (the first
replica on a node: builds and writes the cache file) and `warm` (every later one: maps it).
Registration with the mesh (Serve's replica start, the registry's calls) is not in it: it is the
same with or without the cache. The processes' anonymous memory (what no other process can
share) shows what mapping saves per replica beside the first. Each start's
first-prefill logits are compared bitwise with the `off` start's.

Targets: a warm start's `load_model` at most 0.25x an `off` one's, its whole start at most 0.75x,
and the logits of every start bitwise equal.

    python bench/replica_startup.py --models small smollm2 --repeats 3

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STARTED, STARTED_WALL = time.perf_counter(), time.time()
TARGETS = {
    "warm_load_le_0.25x_off": "a warm start's load_model <= 0.25x a start without the cache",
    "warm_start_le_0.75x_off": "a warm start, imports to first prefill, <= 0.75x one without",
    "logits_bitwise_equal": "every start's first-prefill logits equal the uncached start's",
}
KINDS = ("off", "cold", "warm")


def child(model: str, cache: str, num_blocks: int) -> dict[str, Any]:
    """One replica's start, timed in its own process (this script run with `--child`)."""
    import torch

    from common.kv_cache import KVCache
    from common.model.default import default_model_path
    from common.model.loader import load_model

    imported = time.perf_counter()
    folder = default_model_path(model)
    loaded = load_model(folder, weight_cache=None if cache == "off" else Path(cache))
    load_done = time.perf_counter()
    mc = loaded.config
    KVCache(mc.num_hidden_layers, num_blocks, 16, mc.num_key_value_heads, mc.head_dim,
            getattr(torch, mc.dtype), torch.device("cpu"))  # fmt: skip
    kv_done = time.perf_counter()
    with torch.inference_mode():
        logits = loaded.forward_prefill(torch.arange(8, 72), [64])
    done = time.perf_counter()
    return {
        "started_wall": STARTED_WALL,
        "imports_s": imported - STARTED,
        "load_s": load_done - imported,
        "kv_s": kv_done - load_done,
        "first_prefill_s": done - kv_done,
        "start_s": done - STARTED,
        "anonymous_mb": anonymous_mb(),
        "logits": hashlib.sha256(logits.numpy().tobytes()).hexdigest()[:16],
    } | (load_parts(folder) if cache == "off" else {})


def load_parts(folder: Path) -> dict[str, float]:
    """`load_model`'s pieces without a cache, timed again after the start (the checkpoint's pages
    now cached): reading the tensors, fusing q/k/v and gate/up, the column-major layout, and
    packing the projections' panels."""
    from common.config import ModelConfig, env
    from common.model.linear import pack_linears
    from common.model.loader import build_model, column_major, fuse_projections, load_hf_state

    times = [time.perf_counter()]
    config = ModelConfig.from_folder(folder, None)
    state = load_hf_state(folder, config)
    times.append(time.perf_counter())
    state = fuse_projections(state, config.num_hidden_layers)
    times.append(time.perf_counter())
    for name in [n for n in state if n.endswith("_proj.weight")]:
        state[name] = column_major(state[name])
    times.append(time.perf_counter())
    model = build_model(folder, None, env("WEIGHT_DTYPE"))  # the packing alone, timed below
    times.append(time.perf_counter())
    pack_linears(model)
    times.append(time.perf_counter())
    names = ("read_s", "fuse_s", "layout_s", None, "pack_s")
    return {n: b - a for n, a, b in zip(names, times, times[1:], strict=False) if n is not None}


def anonymous_mb() -> float:
    """This process's anonymous memory (smaps_rollup): what no other process can share, unlike
    pages of a mapped file (which count as private too while no one else maps them)."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError("no Anonymous line in /proc/self/smaps_rollup")


def start(model: str, cache: str, num_blocks: int) -> dict[str, Any]:
    """One start in a fresh interpreter; `interpreter_s`: from launching it to its first line."""
    launched = time.time()
    done = subprocess.run(
        [sys.executable, __file__, "--child", model, cache, "--num-blocks", str(num_blocks)],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    figures = dict(json.loads(done.stdout.strip().splitlines()[-1]))
    return {"interpreter_s": figures.pop("started_wall") - launched, **figures}


def measure(model: str, repeats: int, num_blocks: int) -> dict[str, Any]:
    """`repeats` rounds of off, cold, warm starts of `model`; medians per kind."""
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="weight-cache-") as cache:
            runs["off"].append(start(model, "off", num_blocks))
            runs["cold"].append(start(model, cache, num_blocks))  # writes the file
            runs["warm"].append(start(model, cache, num_blocks))  # maps it
    out: dict[str, Any] = {}
    for kind, rows in runs.items():
        figures = {k: round(statistics.median(r[k] for r in rows), 3)
                   for k in rows[0] if k != "logits"}  # fmt: skip
        figures["start_s"] = round(figures["start_s"] + figures["interpreter_s"], 3)
        out[kind] = figures | {"logits": sorted({r["logits"] for r in rows})}
    off, warm = out["off"], out["warm"]
    out["warm_over_off"] = {
        "load": round(warm["load_s"] / off["load_s"], 3),
        "start": round(warm["start_s"] / off["start_s"], 3),
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["small", "smollm2"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-blocks", type=int, default=512, help="the KV cache's blocks")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "CACHE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.num_blocks)))
        return
    results = {model: measure(model, args.repeats, args.num_blocks) for model in args.models}
    for model, r in results.items():
        for kind in KINDS:
            f = r[kind]
            print(f"{model:<8} {kind:<5} python {f['interpreter_s']:5.2f} s  "
                  f"imports {f['imports_s']:6.2f} s  load {f['load_s']:6.2f} s"
                  f"  kv {f['kv_s']:5.2f} s  prefill {f['first_prefill_s']:5.2f} s  "
                  f"start {f['start_s']:6.2f} s  anon {f['anonymous_mb']:7.1f} MB")  # fmt: skip
        parts = "  ".join(
            f"{k[:-2]} {r['off'][k]:.2f} s" for k in ("read_s", "fuse_s", "layout_s", "pack_s")
        )
        print(f"{model:<8} load_model's pieces without the cache: {parts}")
    logits_equal = all(
        len({h for kind in KINDS for h in r[kind]["logits"]}) == 1 for r in results.values()
    )
    print(json.dumps({
        "models": results,
        "repeats": args.repeats,
        "targets": TARGETS,
        "targets_met": {
            "warm_load_le_0.25x_off": all(r["warm_over_off"]["load"] <= 0.25
                                          for r in results.values()),
            "warm_start_le_0.75x_off": all(r["warm_over_off"]["start"] <= 0.75
                                           for r in results.values()),
            "logits_bitwise_equal": logits_equal,
        },
    }))  # fmt: skip


if __name__ == "__main__":
    main()
