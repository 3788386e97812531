"""Early q's model cost (Lamina 4.2.2, `attention_overlap`): the fused pre-attention against its
two halves, in one process.

    python bench/early_q.py [--model small] [--rows 8 32] [--repeats 30] [--threads 1]

Three ways to compute a layer's q, k and v, timed over all the model's layers, interleaved round by
round (median of `--repeats`):

- `fused`: `pre_attention` (norm, the packed fused QKV projection, RoPE), what a step without
  overlap runs;
- `split_before`: the halves as they were before `PackedLinear.forward_rows`: `F.linear` (MKL,
  repacking the weight every call) on the fused weight's q rows, then on its k/v rows;
- `split_packed`: `pre_attention_q` + `pre_attention_kv` as they are now: each half on the fused
  weight's panels (float32, the extension's GEMM) or on its own oneDNN-packed copy of its rows.

And the whole dense part of a step (every layer's pre-attention and `post_attention`, attention
skipped: its output is q) with the fused and the packed split pre-attention, the step's "model"
time of bench/disagg.py's breakdown less the runner's Python.

`--threads 1` is the engine's default on a 2-core machine (every core but one). Targets:
split_packed / fused <= 1.10 at every row count (the halves cost what the fused call costs),
split_packed / split_before < 1 (the packed halves are faster than the F.linear ones), and the
dense step with the packed halves within 1.05x of the fused one. The last line is one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from common.model.default import PRESETS, default_model_path
from common.model.llama import LlamaDecoderLayer, LlamaForCausalLM, RopeAt
from common.model.loader import load_model


def split_before(layer: LlamaDecoderLayer, x: torch.Tensor, rope: RopeAt) -> torch.Tensor:
    """pre_attention_q + pre_attention_kv as they were: F.linear on the fused weight's slices."""
    attn = layer.self_attn
    h = layer.input_layernorm.forward(x)
    q_size = attn.num_heads * attn.head_dim
    q = F.linear(h, attn.qkv_proj.weight[:q_size])
    rope.rotate_heads_(q, attn.num_heads, attn.head_dim)
    kv = F.linear(h, attn.qkv_proj.weight[q_size:])
    rope.rotate_heads_(kv, attn.num_kv_heads, attn.head_dim)
    return q.view(-1, attn.num_heads, attn.head_dim)


def split_packed(layer: LlamaDecoderLayer, x: torch.Tensor, rope: RopeAt) -> None:
    h, _ = layer.pre_attention_q(x, rope)
    layer.pre_attention_kv(h, rope)


def fused(layer: LlamaDecoderLayer, x: torch.Tensor, rope: RopeAt) -> None:
    layer.pre_attention(x, rope)


def dense_step(model: LlamaForCausalLM, x: torch.Tensor, rope: RopeAt, how: str) -> None:
    """Every layer's dense part, attention skipped (q stands in for its output)."""
    for layer in model.layers:
        if how == "split_packed":
            h, q = layer.pre_attention_q(x, rope)
            layer.pre_attention_kv(h, rope)
        elif how == "split_before":
            q = split_before(layer, x, rope)
        else:
            q, _, _ = layer.pre_attention(x, rope)
        x = layer.post_attention(x, q)


def measure(model: LlamaForCausalLM, rows: int, repeats: int) -> dict[str, float]:
    """Median ms over all layers per variant, the variants interleaved round by round."""
    torch.manual_seed(rows)
    x = torch.randn(rows, model.config.hidden_size)
    rope = model.rotary_at(torch.arange(rows) * 7 + 100)
    runs: dict[str, Callable[[], None]] = {
        name: (lambda f=f: [f(layer, x, rope) for layer in model.layers])  # type: ignore[misc]
        for name, f in (("fused", fused), ("split_before", split_before),
                        ("split_packed", split_packed))
    }  # fmt: skip
    for how in ("fused", "split_before", "split_packed"):
        runs[f"step_{how}"] = lambda how=how: dense_step(model, x, rope, how)  # type: ignore[misc]
    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.inference_mode():
        for run in runs.values():  # warm-up: packs the slices on first use, as a step would
            run()
        for _ in range(repeats):
            for name, run in runs.items():
                started = time.perf_counter()
                run()
                times[name].append((time.perf_counter() - started) * 1e3)
    return {name: round(statistics.median(t), 3) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small", help="a preset (tiny, small) or a model folder")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    # NOTE: run as a script, Python puts bench/ first on sys.path, where bench/profile.py would
    # shadow the standard library's `profile` (torch's lazy dynamo import needs cProfile).
    if sys.path[0] == str(Path(__file__).resolve().parent):
        sys.path[0] = str(Path(__file__).resolve().parents[1])
    torch.set_num_threads(args.threads)
    path = str(default_model_path(args.model)) if args.model in PRESETS else args.model
    model = load_model(path)
    loadavg_before = Path("/proc/loadavg").read_text().split()[:3]
    figures: dict[str, dict[str, float]] = {}
    for rows in args.rows:
        ms = measure(model, rows, args.repeats)
        ms["split_packed_over_fused"] = round(ms["split_packed"] / ms["fused"], 3)
        ms["split_packed_over_before"] = round(ms["split_packed"] / ms["split_before"], 3)
        ms["step_split_over_fused"] = round(ms["step_split_packed"] / ms["step_fused"], 3)
        ms["step_before_over_fused"] = round(ms["step_split_before"] / ms["step_fused"], 3)
        figures[str(rows)] = ms
        print(f"rows {rows}: pre-attention over {len(model.layers)} layers, ms: fused "
              f"{ms['fused']}, split before {ms['split_before']}, split packed "
              f"{ms['split_packed']} ({ms['split_packed_over_fused']}x fused, "
              f"{ms['split_packed_over_before']}x before); dense step, ms: fused "
              f"{ms['step_fused']}, split before {ms['step_split_before']}, split packed "
              f"{ms['step_split_packed']}")  # fmt: skip
    met = {
        "split_packed_over_fused_le_1.10": all(
            f["split_packed_over_fused"] <= 1.10 for f in figures.values()
        ),
        "split_packed_faster_than_before": all(
            f["split_packed_over_before"] < 1 for f in figures.values()
        ),
        "step_split_over_fused_le_1.05": all(
            f["step_split_over_fused"] <= 1.05 for f in figures.values()
        ),
    }
    print(json.dumps({
        "figures": figures, "model": args.model, "threads": args.threads,
        "loadavg_before": loadavg_before,
        "loadavg_after": Path("/proc/loadavg").read_text().split()[:3],
        "targets": list(met), "targets_met": met,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
