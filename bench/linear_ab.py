"""Paired A/B of two builds of the csrc projection GEMM on a decode step's shapes, in one process.

Like bench/attention_ab.py (whose `build` it uses: each source tree as its own module), for the
panel GEMM (`csrc/linear_kernel.h`): one decode step's projections of a preset at `--rows` rows
(the step's batch; per layer the fused QKV, O, gate|up with its activation and down, then the LM
head; random weights packed as each weight dtype's panels, all layers' weights distinct, so a
step streams them from memory as the engine's does), build a and build b alternating which goes
first, the C read probe after each pair. It prints each build's GB/s of weights per dtype, its
ratio to the probe and b / a.

    PYTHONPATH=. .venv/bin/python bench/linear_ab.py BASE_CSRC_DIR csrc --threads 2 --clock wall
    (BASE_CSRC_DIR: e.g. `git archive main csrc | tar -x -C /tmp/base`, then /tmp/base/csrc)

With `--threads 1 --clock thread` the GEMM runs on the calling thread in CPU time (what the
scheduler gives other processes left out); `--layers 1` keeps a step's weights in the LLC, the
kernels' compute rate rather than the memory's. The last line is one JSON object with `targets`
(b at least a's rate per dtype) and `targets_met`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

# NOTE: before torch loads its OpenMP runtime: the read probe's threads would spin after each
# probe and hold a core the GEMM's next call needs (bench/attention_ab.py's NOTE).
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import torch  # noqa: E402
from torch.utils.dlpack import to_dlpack  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path[0] = str(REPO)  # NOTE: not bench/, whose profile.py would shadow the stdlib's

from bench.attention_ab import CLOCKS, build  # noqa: E402
from common.model.default import PRESET_KEYS, RANDOM_PRESETS  # noqa: E402
from common.model.linear import WEIGHT_DTYPES, pack_panels, quantize_int8  # noqa: E402

PROBE_BYTES = 512 << 20  # well past the last-level cache
STEPS = 10  # decode steps a timing spans


class Step:
    """A decode step's projection weights of one dtype, packed for a panel width: per weight its
    panels, int8 scales (None for other dtypes) and output columns."""

    def __init__(
        self, preset: str, weight_dtype: str, width: int, layers: int | None, rows: int = 1
    ) -> None:
        shape = RANDOM_PRESETS[preset]
        vocab, hidden, inter = (shape[k] for k in PRESET_KEYS[:3])
        num_layers, heads, kv_heads = (shape[k] for k in PRESET_KEYS[3:6])
        qkv = hidden + 2 * kv_heads * (hidden // heads)
        shapes = [(qkv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
        self.weight_dtype, self.width, self.rows = weight_dtype, width, rows
        self.layers = [[self._pack(o, i) for o, i in shapes] for _ in range(layers or num_layers)]
        self.head = self._pack(vocab, hidden)
        self.x_hidden, self.x_inter = torch.randn(rows, hidden), torch.randn(rows, inter)
        self.act = torch.empty(rows, inter)
        every = [w for layer in self.layers for w in layer] + [self.head]
        self.nbytes = sum(p.nbytes + (0 if s is None else s.nbytes) for p, s, _ in every)

    def _pack(self, out_features: int, in_features: int) -> tuple[torch.Tensor, Any, torch.Tensor]:
        weight = torch.randn(out_features, in_features) * 0.02
        out = torch.empty(self.rows, out_features)
        if self.weight_dtype != "int8":
            dtype = torch.bfloat16 if self.weight_dtype == "bfloat16" else torch.float32
            return pack_panels(weight.to(dtype), self.width), None, out
        q, scales = quantize_int8(weight)
        panels = pack_panels(q, self.width)
        padded = torch.zeros(panels.shape[0] * self.width)
        padded[:out_features] = scales
        return panels, padded, out

    def run(self, ext: Any, threads: int) -> None:
        """One step's calls on module `ext`: the engine's, one extension call a projection."""
        x = self.x_hidden
        for qkv, o, (panels, scales, gate_up), down in self.layers:
            _linear(ext, x, qkv, threads)
            _linear(ext, x, o, threads)
            ext.linear_silu_and_mul(to_dlpack(x), to_dlpack(panels), to_dlpack(gate_up),
                                    to_dlpack(self.act), threads, **_scales(scales))  # fmt: skip
            _linear(ext, self.x_inter, down, threads)
        _linear(ext, x, self.head, threads)


def _linear(ext: Any, x: torch.Tensor, weight: tuple, threads: int) -> None:
    panels, scales, out = weight
    ext.linear(to_dlpack(x), to_dlpack(panels), to_dlpack(out), None, 0, threads,
               **_scales(scales))  # fmt: skip


def _scales(scales: torch.Tensor | None) -> dict[str, Any]:
    return {} if scales is None else {"scales": to_dlpack(scales)}


def seconds_per_step(step: Step, ext: Any, threads: int, clock: Any) -> float:
    """The best of 3 timings of STEPS steps, per step."""
    best = float("inf")
    for _ in range(3):
        start = clock()
        for _ in range(STEPS):
            step.run(ext, threads)
        best = min(best, (clock() - start) / STEPS)
    return best


def compare(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(work / "mod"))
    mods = {tag: importlib.import_module(f"phasemesh_attention_kernel_{tag}") for tag in "ab"}
    torch.set_num_threads(args.threads)
    clock = CLOCKS[args.clock]
    width = mods["a"].linear_panel_width()
    steps = {d: Step(args.preset, d, width, args.layers, args.rows) for d in args.dtypes}
    gbps: dict[str, list[float]] = {f"{t}_{d}": [] for t in "ab" for d in steps}
    probe_buffer, probe = torch.ones(PROBE_BYTES // 4), []
    for ext in mods.values():  # warm up: page faults, the pools' threads
        for step in steps.values():
            step.run(ext, args.threads)
    for repeat in range(args.repeats):
        for tag in "ab" if repeat % 2 == 0 else "ba":
            for name, step in steps.items():
                per_step = seconds_per_step(step, mods[tag], args.threads, clock)
                gbps[f"{tag}_{name}"].append(step.nbytes / per_step / 1e9)
        start = CLOCKS["wall"]()
        mods["a"].read_sum(probe_buffer, args.threads)
        probe.append(PROBE_BYTES / (CLOCKS["wall"]() - start) / 1e9)
    probe_gbps = statistics.median(probe)
    rows: dict[str, Any] = {"read_probe_gbps": round(probe_gbps, 1)}
    for name, step in steps.items():
        a, b = (statistics.median(gbps[f"{t}_{name}"]) for t in "ab")
        rows[name] = {
            "weight_mb_per_step": round(step.nbytes / 1e6, 1),
            "a_gbps": round(a, 1), "b_gbps": round(b, 1),
            "a_over_read_probe": round(a / probe_gbps, 3),
            "b_over_read_probe": round(b / probe_gbps, 3),
            "b_over_a": round(b / a, 3),
        }  # fmt: skip
        print(name, rows[name], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("a", type=Path, help="baseline csrc directory")
    parser.add_argument("b", type=Path, help="variant csrc directory")
    parser.add_argument("--preset", default="small", choices=sorted(RANDOM_PRESETS))
    parser.add_argument("--dtypes", nargs="+", default=list(WEIGHT_DTYPES), choices=WEIGHT_DTYPES)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers: from cache")
    parser.add_argument("--rows", type=int, default=1, help="rows a call (the decode batch)")
    args = parser.parse_args()
    if args.rows < 1:  # before the minutes of building both trees
        parser.error(f"--rows {args.rows}: a call has at least one row")
    work = Path(tempfile.mkdtemp(prefix="linear_ab_"))
    try:
        for tag, src in (("a", args.a), ("b", args.b)):
            build(src, tag, work)
        rows = compare(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    targets = {f"{d}_b_over_a": ">= 1.0" for d in args.dtypes}
    met = {f"{d}_b_over_a": rows[d]["b_over_a"] >= 1.0 for d in args.dtypes}
    print(json.dumps({"preset": args.preset, "threads": args.threads, "clock": args.clock,
                      "load": os.getloadavg()[0], "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
                      "dtypes": rows, "targets": targets, "targets_met": met}))  # fmt: skip


if __name__ == "__main__":
    main()
