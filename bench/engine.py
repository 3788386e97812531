"""Decode throughput: PhaseMesh's engine against `transformers` generate, same weights, same run.

    python bench/engine.py [--model PATH|PRESET] [--batches 1 8 32] [--repeats 5] [--no-unpacked]
                           [--no-onednn] [--weight-dtypes float32 bfloat16 int8] [--stages]
                           [--scheduler-steps 8] [--weight-dtype-repeats 9]

Two more sides are the same engine with other projections (common/model/linear.py):
`engine_unpacked` on plain `F.linear` (MKL), what the packing alone gives, and `engine_onednn` on
oneDNN-packed weights (float32 models, where the extension's panel GEMM is the default).

Per-step decode time is measured by differencing two generation lengths (64 and 16 new tokens)
so that prefill cancels out, after one untimed generation per side; tokens/s = batch / step
time. Prompts have mixed lengths (16-128).

After the timed runs, one more engine run per batch size times the stages of each decode step
(`StageTimer`: wrappers around the engine's own methods, a fraction of a microsecond each): the
scheduler, input preparation, each layer's pre-attention (norm, QKV projection, RoPE), attention
(KV write and paged decode), post-attention (O projection, norm, MLP), or all of them as the fused
layers' one call where a decode step takes it (`layers_fused`, common/model/fused_decode.py), the
LM head, sampling, and the rest (appending tokens, Python between the stages).

Then batch-1 decode per projection weight dtype (`weight_dtypes`: the same float32 model, its
projections packed as float32, bfloat16 or int8 panels; activations float32), the engines
alternating with the C read probe (`readsum`, as bench/attention.py runs it) in every repeat: each
dtype's tokens/s, the projection weights' bytes a token reads (every packed panel and scale, the
LM head's too), their GB/s and its ratio to the probe, and tokens/s over float32's. At batch 1 a
step reads each weight once, so tokens/s x bytes <= the read bandwidth: fewer bytes per weight
is the only way past float32's rate. These engines decode up to `--scheduler-steps` greedy
iterations a call (the engine's `num_scheduler_steps`: the step's Python, paid once per call, is
what keeps a small step off the bound), each beside the same engine at one a call, alternating:
both rates and the steps' gain (`steps_over_single`). The rows name the kernels' pool spin
they ran with (`kernel_pool_spin_us`, csrc/thread_pool.h). `--batches` with no sizes runs this
part alone.
`--stages` adds, beside each dtype's engine and alternating with it, the same engine with its
decode layers' stages called one by one (`ModelRunner.fuse_decode` off): the fused layers' gain
in one run.

With `--model smollm2` and llama.cpp's environment built (bench/llamacpp_env.sh), llama.cpp runs
in every batch's repeats too (bench/llamacpp.py): SmolLM2's F32, BF16 and shipped Q4_1 GGUF files,
one sequence per prompt, beside PhaseMesh engines with bfloat16 projection panels at both matmul
precisions (`highest`: activations float32; `medium`: rounded to bfloat16 in the projections, as
llama.cpp's BF16 computes) and the float32 engine on a bfloat16 KV cache (`engine_kv16`:
llama.cpp's KV cache is 16-bit, f16, by default); each batch's row has PhaseMesh's tok/s over
llama.cpp's at equal bits per weight (each float32 side over F32, each bfloat16 side over BF16),
and the leading greedy tokens each pair shares. `--no-llamacpp` skips it; without the
environment or on another model it is skipped and the JSON says why; a worker that dies leaves
`llamacpp.failed` (its last output), its targets unjudged, and PhaseMesh's figures.

The last line is one JSON object with both sides, their ratio and the engine's breakdown per batch
size, the weight-dtype rows, `targets` and `targets_met`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

# NOTE: run as a script, bench/ is first on sys.path: the repository instead, so that `bench.`
# imports resolve and bench/profile.py does not shadow the standard library's `profile`.
if sys.path[0] == str(Path(__file__).resolve().parent):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.machine import cpu_variant  # noqa: E402
from common.engine.core import LLMEngine
from common.model.default import PRESETS, default_model_path
from common.model.linear import (
    WEIGHT_DTYPES,
    PackedLinear,
    kernel_gemm_available,
    matmul_precision,
    pack_linears,
    packed_weight_bytes,
    unpack_linears,
)
from common.sampling_params import SamplingParams
from common.scheduling.batching import Phase

if TYPE_CHECKING:
    from bench import llamacpp

LONG, SHORT = 64, 16
MAX_PAIR_ATTEMPTS = 5  # a side's long/short pair, when a busy spell left it with no step time
TARGET_RATIO = 2.0  # engine / transformers decode tok/s, at every batch size (issue 20)
# Batch-1 decode tok/s over float32's, per weight dtype, and every dtype's weight GB/s over the
# read probe's (issue 54).
TARGET_OVER_FLOAT32 = {"bfloat16": 1.8, "int8": 3.2}
TARGET_OVER_READ_PROBE = 0.85
READ_PROBE_BYTES = 512 << 20  # well past the last-level cache


def prompts_for(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 129, (batch,), generator=gen).tolist()
    return [torch.randint(8, vocab, (n,), generator=gen).tolist() for n in lengths]


def engine_seconds(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> float:
    return engine_run(engine, prompts, new_tokens)[0]


def engine_run(
    engine: LLMEngine, prompts: list[list[int]], new_tokens: int
) -> tuple[float, list[list[int]]]:
    """One greedy generation: its seconds and each prompt's output token ids."""
    # Token ids only, like transformers' generate: no text (a server's text is the router's job).
    params = SamplingParams(
        max_tokens=new_tokens, temperature=0.0, ignore_eos=True, detokenize=False
    )
    start = time.perf_counter()
    tokens = engine.generate(prompts, params)
    return time.perf_counter() - start, tokens


def engine_tokens(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    return engine_run(engine, prompts, new_tokens)[1]


def hf_seconds(model, prompts: list[list[int]], new_tokens: int) -> float:  # type: ignore[no-untyped-def]
    device = model.device
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):  # left padding, as batched generation needs
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
        )  # fmt: skip
    out.tolist()  # on a GPU: the work is done once its tokens are on the host
    return time.perf_counter() - start


def decode_tokens_per_s(runs: dict[str, Callable], prompts: list[list[int]], repeats: int) -> dict:
    """Median over repeats of batch / per-step time for each side (`step_seconds`). The sides
    alternate within every repeat, so a busy spell on a shared machine hits both rather than
    one. Each side generates once untimed first: its first run at a batch size builds what a
    side builds once (the engine's fused layers, llama.cpp's context for that many sequences)
    and ran at about half its later rate, a third of a median of three."""
    for run in runs.values():
        run(prompts, SHORT)
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            rates[name].append(len(prompts) / step_seconds(name, run, prompts))
    return {name: statistics.median(r) for name, r in rates.items()}


def step_seconds(name: str, run: Callable, prompts: list[list[int]]) -> float:
    """One decode step's seconds, from two lengths (`run(prompts, tokens)` gives its seconds):
    the prefill and every fixed cost cancel. A busy spell over the short run alone can leave
    the difference at zero or below, which is no step time: that pair runs again."""
    for _attempt in range(MAX_PAIR_ATTEMPTS):
        step = (run(prompts, LONG) - run(prompts, SHORT)) / (LONG - SHORT)
        if step > 0:
            return step
    raise RuntimeError(f"{name}: the {LONG}-token run never outlasted the {SHORT}-token run in "
                       f"{MAX_PAIR_ATTEMPTS} tries: the machine is too busy to time")  # fmt: skip


class StageTimer:
    """Wraps an engine's stage methods (on the instances: the classes are untouched) and sums
    each stage's wall time over decode steps; prefill steps are timed but not counted."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.totals: dict[str, float] = defaultdict(float)
        self.steps = 0
        self._current: dict[str, float] = defaultdict(float)
        self._decode = False
        runner, model = engine.runner, engine.runner.model
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine.scheduler, "update", "schedule")
        self._wrap(runner, "prepare", "prepare_inputs")
        self._wrap(model, "embed", "embed_rope")
        self._wrap(model, "rotary_at", "embed_rope")
        self._wrap(runner, "attend", "attention")
        self._wrap(model, "compute_logits", "lm_head")
        self._wrap(engine.sampler, "sample", "sampling")
        for layer in model.layers:
            self._wrap(layer, "pre_attention", "pre_attention")
            self._wrap(layer, "post_attention", "post_attention")
        if runner._fused is not None:  # built by a warm-up: decode steps' layers in one call
            self._wrap(runner._fused, "run", "layers_fused")
        run = runner.run

        def timed_run(inputs: Any, keep_hidden: bool = False) -> Any:
            self._decode = inputs.phase is Phase.DECODE
            return run(inputs, keep_hidden)

        runner.run = timed_run  # type: ignore[method-assign]
        step = engine.step

        def timed_step() -> Any:
            self._current.clear()
            start = time.perf_counter()
            out = step()
            total = time.perf_counter() - start
            if self._decode:
                self.steps += 1
                for stage, seconds in self._current.items():
                    self.totals[stage] += seconds
                self.totals["total"] += total
            return out

        engine.step = timed_step  # type: ignore[method-assign]

    def _wrap(self, owner: Any, method: str, stage: str) -> None:
        inner = getattr(owner, method)
        current = self._current

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                current[stage] += time.perf_counter() - start

        # NOTE: object.__setattr__: an nn.Module's own __setattr__ would be fine too, but this
        # says plainly that only this instance's attribute changes.
        object.__setattr__(owner, method, timed)

    def us_per_step(self) -> dict[str, float]:
        """Mean microseconds per decode step by stage; `other` is the step's unaccounted rest
        (appending tokens, finish checks, Python between the stages)."""
        n = max(self.steps, 1)
        per_step = {stage: seconds / n * 1e6 for stage, seconds in self.totals.items()}
        staged = sum(v for k, v in per_step.items() if k != "total")
        # The layer stages run inside the forward: the forward's own rest is not separable from
        # `other` here, and attention is inside neither pre nor post.
        per_step["other"] = per_step.get("total", 0.0) - staged
        return {k: round(v, 1) for k, v in sorted(per_step.items())}


def engine_breakdown(path: str, prompts: list[list[int]]) -> dict[str, float]:
    """One instrumented engine run of LONG tokens: microseconds per decode step by stage."""
    engine = LLMEngine.from_path(path, num_blocks=2048)
    engine_seconds(engine, prompts, SHORT)  # warm up
    timer = StageTimer(engine)
    engine_seconds(engine, prompts, LONG)
    return timer.us_per_step()


# The engine's other sides: (name in the printed line, the ratio's JSON key, what it measures).
ALTERNATES = {
    "engine_unpacked": ("unpacked engine", "packed_vs_unpacked", "packing"),
    "engine_onednn": ("oneDNN engine", "kernel_vs_onednn", "kernel GEMM"),
}


def engines(
    path: str, unpacked: bool, onednn: bool, bfloat16: bool = False
) -> dict[str, LLMEngine]:
    """The engine, and the alternates asked for: on plain `F.linear`, on oneDNN's packing (a
    float32 model, where the kernel GEMM is the default), and with llama.cpp's sides
    (`bfloat16`) on a bfloat16 KV cache (`engine_kv16`: llama.cpp's KV is 16-bit too) and on
    bfloat16 projection panels (two engines: one runs at matmul precision "medium",
    `SIDE_PRECISION`)."""
    sides = {"engine": LLMEngine.from_path(path, num_blocks=2048)}
    if bfloat16:
        sides["engine_kv16"] = LLMEngine.from_path(path, num_blocks=2048, kv_cache_dtype="bfloat16")
        for name in ("engine_bfloat16", "engine_bfloat16_medium"):
            sides[name] = LLMEngine.from_path(path, num_blocks=2048)
            pack_linears(sides[name].model, weight_dtype="bfloat16")
    if unpacked:
        sides["engine_unpacked"] = LLMEngine.from_path(path, num_blocks=2048)
        unpack_linears(sides["engine_unpacked"].model)
    if onednn and kernel_gemm_available() and sides["engine"].model_config.dtype == "float32":
        sides["engine_onednn"] = LLMEngine.from_path(path, num_blocks=2048)
        pack_linears(sides["engine_onednn"].model, backend="onednn")
    return sides


# Sides whose every call runs at a matmul precision other than the process's default "highest"
# (common/model/linear.py: bfloat16 panels times x rounded to bfloat16).
SIDE_PRECISION = {"engine_bfloat16_medium": "medium"}


def side_call(name: str, engine: LLMEngine, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn(engine, ...)` as side `name` runs it: at its matmul precision, if it has one."""
    call = functools.partial(fn, engine)
    precision = SIDE_PRECISION.get(name)
    return call if precision is None else functools.partial(_at_precision, precision, call)


def _at_precision(precision: str, call: Callable[..., Any], *args: Any) -> Any:
    with matmul_precision(precision):
        return call(*args)


def batch_row(batch: int, rates: dict[str, float], breakdown: dict) -> tuple[dict, str]:
    """One batch's JSON row and printed line."""
    ours, theirs = rates["engine"], rates["transformers"]
    row = {
        "engine_tok_s": round(ours, 1),
        "transformers_tok_s": round(theirs, 1),
        "ratio": round(ours / theirs, 2),
        "engine_us_per_decode_step": breakdown,
    }
    line = f"batch {batch:3d}: engine {ours:9.1f} tok/s  transformers {theirs:9.1f} tok/s  "
    line += f"ratio {ours / theirs:5.2f}"
    for side, (label, key, what) in ALTERNATES.items():
        if side in rates:
            other = rates[side]
            row |= {f"{side}_tok_s": round(other, 1), key: round(ours / other, 2)}
            line += f"  ({label} {other:9.1f} tok/s: {what} x{ours / other:4.2f})"
    return row, line


STAGES = "_stages"  # the suffix of a weight dtype's engine with its layers' stages one by one
SINGLE = "_single_step"  # ... and of the one that decodes one iteration a call
DEFAULT_SCHEDULER_STEPS = 8


def weight_dtype_engines(
    path: str, dtypes: list[str], stages: bool, scheduler_steps: int = 1
) -> dict[str, LLMEngine]:
    """One batch-1 engine per projection weight dtype (a build without its panels falls back,
    with a logged note, and the row says which dtype it ran), decoding up to `scheduler_steps`
    greedy iterations a call; beside each, with `scheduler_steps` > 1, the same engine at one a
    call, and with `stages` the same engine with its decode layers' stages one by one instead
    of the fused layers (one iteration a call: the steps need the fused layers)."""
    sides = {}
    suffixes = [""] + [SINGLE] * (scheduler_steps > 1) + [STAGES] * stages
    for weight_dtype in dtypes:
        for suffix in suffixes:
            steps = scheduler_steps if not suffix else 1
            engine = LLMEngine.from_path(path, num_blocks=256, num_scheduler_steps=steps)
            pack_linears(engine.model, weight_dtype=weight_dtype)
            engine.runner.fuse_decode = suffix != STAGES
            sides[weight_dtype + suffix] = engine
    return sides


def weight_dtype_rows(
    path: str,
    dtypes: list[str],
    repeats: int,
    probe_bytes: int = READ_PROBE_BYTES,
    stages: bool = False,
    scheduler_steps: int = 1,
) -> tuple[dict, list[str]]:
    """Batch-1 decode per weight dtype beside the read probe (over `probe_bytes`), alternating
    every repeat: median tok/s (up to `scheduler_steps` iterations a call), bytes per token,
    GB/s, its share of the probe, and tok/s over float32's; with `scheduler_steps` > 1, each
    dtype's tok/s at one iteration a call and the steps' gain over it (`steps_over_single`);
    with `stages`, each dtype's tok/s with its layers' stages one by one and the fused layers'
    tok/s over that (`fused_over_stages`)."""
    import phasemesh_attention_kernel as kernel

    sides = weight_dtype_engines(path, dtypes, stages, scheduler_steps)
    rates, probe_gbps = rates_beside_probe(sides, repeats, probe_bytes)
    rows: dict[str, Any] = {
        "read_probe_gbps": round(probe_gbps, 2),
        "scheduler_steps": scheduler_steps,
    }
    if hasattr(kernel, "pool_spin_us"):  # the kernels' workers spin this long between calls
        rows["kernel_pool_spin_us"] = kernel.pool_spin_us()
    lines = [f"read probe (readsum, {torch.get_num_threads()} threads): {probe_gbps:.1f} GB/s"]
    for name in dtypes:
        rows[name], line = weight_dtype_row(name, sides[name], rates, probe_gbps)
        lines.append(line)
    return rows, lines


def rates_beside_probe(
    sides: dict[str, LLMEngine], repeats: int, probe_bytes: int
) -> tuple[dict[str, float], float]:
    """Each side's median batch-1 tok/s and the read probe's median GB/s (the best of 3 reads
    of `probe_bytes` after every repeat of the sides), after one untimed generation a side."""
    from phasemesh_attention_kernel import read_sum

    prompts = prompts_for(1, next(iter(sides.values())).model_config.vocab_size)
    threads = torch.get_num_threads()
    probe_buffer = torch.ones(probe_bytes // 4)
    rates: dict[str, list[float]] = {name: [] for name in sides}
    probe: list[float] = []
    for engine in sides.values():  # warm up: first-call packing, page faults
        engine_seconds(engine, prompts, SHORT)
    for _ in range(repeats):
        for name, engine in sides.items():
            run = functools.partial(engine_seconds, engine)
            rates[name].append(1 / step_seconds(name, run, prompts))
        best = min(_timed(lambda: read_sum(probe_buffer, threads)) for _ in range(3))
        probe.append(probe_bytes / best / 1e9)
    return {k: statistics.median(v) for k, v in rates.items()}, statistics.median(probe)


# The sides a dtype's row is compared with, by suffix: (its tok/s key, the ratio's key, the
# printed words, formatted with its tok/s and the ratio).
BESIDE = {
    SINGLE: ("single_step_tok_s", "steps_over_single", "one step a call {:.1f} tok/s: x{:.3f}"),
    STAGES: ("stages_tok_s", "fused_over_stages", "stages {:.1f} tok/s: fused x{:.3f}"),
}


def weight_dtype_row(
    name: str, engine: LLMEngine, rates: dict[str, float], probe_gbps: float
) -> tuple[dict, str]:
    """One weight dtype's JSON row and printed line from the run's median rates."""
    tok_s, nbytes = rates[name], packed_weight_bytes(engine.model)
    gbps = tok_s * nbytes / 1e9
    packed = {m.weight_dtype for m in engine.model.modules() if isinstance(m, PackedLinear)}
    row = {
        "tok_s": round(tok_s, 1),
        "weight_mb_per_token": round(nbytes / 1e6, 1),
        "gbps": round(gbps, 2),
        "over_read_probe": round(gbps / probe_gbps, 3),
        "packed_as": sorted(packed),
    }
    line = f"weights {name:9s}: {tok_s:7.1f} tok/s  {nbytes / 1e6:6.1f} MB/token  "
    line += f"{gbps:5.1f} GB/s ({gbps / probe_gbps:.2f} of the probe)"
    if "float32" in rates:
        row["over_float32"] = round(tok_s / rates["float32"], 2)
        line += f"  x{tok_s / rates['float32']:.2f} float32"
    for suffix, (rate_key, ratio_key, words) in BESIDE.items():
        if name + suffix in rates:
            other = rates[name + suffix]
            row |= {rate_key: round(other, 1), ratio_key: round(tok_s / other, 3)}
            line += f"  ({words.format(other, tok_s / other)})"
    return row, line


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def weight_dtype_targets(rows: dict) -> tuple[dict, dict]:
    """`targets` and `targets_met` of the weight-dtype rows."""
    targets, met = {}, {}
    for name in WEIGHT_DTYPES:
        if name not in rows:
            continue
        targets[f"{name}_over_read_probe"] = f">= {TARGET_OVER_READ_PROBE}"
        met[f"{name}_over_read_probe"] = rows[name]["over_read_probe"] >= TARGET_OVER_READ_PROBE
        if name in TARGET_OVER_FLOAT32 and "over_float32" in rows[name]:
            targets[f"{name}_over_float32"] = f">= {TARGET_OVER_FLOAT32[name]}"
            met[f"{name}_over_float32"] = rows[name]["over_float32"] >= TARGET_OVER_FLOAT32[name]
    return targets, met


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", default=None, help=f"a folder or a preset ({', '.join(PRESETS)})"
    )
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--weight-dtype-repeats", type=int, default=9,
        help="repeats of the batch-1 weight-dtype rows (each a few seconds: their medians move "
        "with the machine's read bandwidth, so they take more than the batch rows)",
    )  # fmt: skip
    parser.add_argument("--no-unpacked", action="store_true", help="skip the F.linear engine")
    parser.add_argument("--no-onednn", action="store_true", help="skip the oneDNN engine")
    parser.add_argument(
        "--weight-dtypes", nargs="*", choices=WEIGHT_DTYPES, default=list(WEIGHT_DTYPES),
        help="batch-1 decode per projection weight dtype (none: skip)",
    )  # fmt: skip
    parser.add_argument(
        "--stages", action="store_true",
        help="beside each weight dtype's engine, one with its decode layers' stages one by one",
    )  # fmt: skip
    parser.add_argument(
        "--scheduler-steps", type=int, default=DEFAULT_SCHEDULER_STEPS,
        help="greedy decode iterations per call of the weight-dtype engines (the engine's "
        "num_scheduler_steps); above 1, each also runs at one a call beside it",
    )  # fmt: skip
    parser.add_argument(
        "--device", default="cpu",
        help="cuda[:N]: the engine and transformers (bfloat16) on that GPU, no CPU-only sides",
    )  # fmt: skip
    parser.add_argument("--no-llamacpp", action="store_true", help="skip llama.cpp's side")
    return parser.parse_args()


def batch_rows(path: str, args: argparse.Namespace, results: dict[str, Any]) -> tuple[dict, dict]:
    """Every side's decode rate per batch into `results["batches"]` (llama.cpp's beside them when
    its environment is there); returns llama.cpp's targets and whether each is met."""
    from transformers import LlamaForCausalLM

    from bench import llamacpp

    skipped = "--no-llamacpp" if args.no_llamacpp else llamacpp.skip_reason(path)
    results["llamacpp"] = {"skipped": skipped}
    llama = None
    if not skipped:
        try:
            llama = llamacpp.LlamaCppSide(torch.get_num_threads())
        except llamacpp.LlamaCppFailed as exc:  # NOTE: PhaseMesh's figures do not need it
            results["llamacpp"] = _llamacpp_failed(None, exc)
    sides = engines(path, not args.no_unpacked, not args.no_onednn, bfloat16=llama is not None)
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for batch in args.batches:
        prompts = prompts_for(batch, sides["engine"].model_config.vocab_size)
        runs: dict[str, Callable] = {
            name: side_call(name, engine, engine_seconds) for name, engine in sides.items()
        }
        runs["transformers"] = functools.partial(hf_seconds, hf)
        try:
            rates = decode_tokens_per_s(runs | (llama.runs() if llama else {}), prompts,
                                        args.repeats)  # fmt: skip
        except llamacpp.LlamaCppFailed as exc:  # this batch again, without it
            results["llamacpp"], llama = _llamacpp_failed(llama, exc), None
            rates = decode_tokens_per_s(runs, prompts, args.repeats)
        breakdown = engine_breakdown(path, prompts)
        results["batches"][str(batch)], line = batch_row(batch, rates, breakdown)
        print(line)
        print("  engine us/step: " + "  ".join(f"{k} {v:.0f}" for k, v in breakdown.items()))
        if llama:
            print(llama.record(batch, rates))
    if skipped:
        return {}, {}
    if llama:
        ours = {name: side_call(name, e, engine_tokens) for name, e in sides.items()}
        try:
            print(llama.agreement(ours, prompts, SHORT))
            results["llamacpp"], llama_targets, llama_met = llama.close()
            return llama_targets, llama_met
        except llamacpp.LlamaCppFailed as exc:
            results["llamacpp"] = _llamacpp_failed(llama, exc)
    return llamacpp.unjudged(args.batches)


def _llamacpp_failed(llama: llamacpp.LlamaCppSide | None, exc: Exception) -> dict[str, Any]:
    """llama.cpp's side died, starting (`llama` None) or mid-run (bench/llamacpp.py): its JSON
    part says why; the bench goes on with PhaseMesh's figures, the llama.cpp targets unjudged."""
    print(f"llama.cpp's side failed, going on without it: {exc}", file=sys.stderr)
    return llama.fail(exc) if llama else {"failed": str(exc)}


def main() -> None:
    args = parse_args()
    if args.model in PRESETS:
        args.model = str(default_model_path(args.model))
    path = args.model or str(default_model_path())
    if args.device != "cpu":
        device_bench(path, args.device, args.batches or DEVICE_BATCHES, args.repeats)
        return
    results: dict[str, Any] = {
        "model": path, "cpu": cpu_variant(), "threads": torch.get_num_threads(), "batches": {},
        "loadavg_before": os.getloadavg()[0], "llamacpp": {"skipped": "no --batches"},
    }  # fmt: skip
    results["targets"] = {f"ratio_batch_{b}": f">= {TARGET_RATIO}" for b in args.batches}
    results["targets_met"] = {}
    if args.batches:  # the sides' memory is freed on return, before the weight-dtype engines
        llama_targets, llama_met = batch_rows(path, args, results)
        results["targets_met"] = {
            f"ratio_batch_{b}": results["batches"][str(b)]["ratio"] >= TARGET_RATIO
            for b in args.batches
        }
        results["targets"] |= llama_targets
        results["targets_met"] |= llama_met
    if args.weight_dtypes:
        results["weight_dtypes_batch_1"], lines = weight_dtype_rows(
            path, args.weight_dtypes, args.weight_dtype_repeats, stages=args.stages,
            scheduler_steps=args.scheduler_steps,
        )  # fmt: skip
        print("\n".join(lines))
        targets, met = weight_dtype_targets(results["weight_dtypes_batch_1"])
        results["targets"] |= targets
        results["targets_met"] |= met
    results["loadavg_after"] = os.getloadavg()[0]
    print(json.dumps(results))


DEVICE_BATCHES = [1, 8, 32, 128]
# The engine over transformers on the same GPU, at these batches and above (issue 53).
DEVICE_TARGET_RATIO, DEVICE_TARGET_FROM_BATCH = 2.0, 32


def device_bench(path: str, device: str, batches: list[int], repeats: int) -> None:
    """The engine (bfloat16, paged attention, CUDA graphs for decode) against transformers'
    generate (bfloat16, its own eager loop and cache) on one GPU: decode tok/s per batch size,
    each side warmed up at each batch first (the engine's graphs for that batch are captured
    then). Prints one line per batch and the JSON object last."""
    from transformers import LlamaForCausalLM

    top = max(batches)
    engine = LLMEngine.from_path(path, num_blocks=(top * (128 + LONG) // 16) + 64,
                                 max_num_seqs=max(top, 64), device=device)  # fmt: skip
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    results: dict[str, Any] = {"model": path, "device": torch.cuda.get_device_name(device),
                               "batches": {}}  # fmt: skip
    for batch in batches:
        prompts = prompts_for(batch, engine.model_config.vocab_size)
        runs: dict[str, Callable] = {
            "engine": functools.partial(engine_seconds, engine),
            "transformers": functools.partial(hf_seconds, hf),
        }
        for run in runs.values():  # warm-up: graph captures, cuBLAS workspaces, the allocator
            run(prompts, LONG)
        rates = decode_tokens_per_s(runs, prompts, repeats)
        ours, theirs = rates["engine"], rates["transformers"]
        results["batches"][str(batch)] = {
            "engine_tok_s": round(ours, 1), "transformers_tok_s": round(theirs, 1),
            "ratio": round(ours / theirs, 2),
        }  # fmt: skip
        print(f"batch {batch:3d}: engine {ours:9.1f} tok/s  transformers {theirs:9.1f} tok/s  "
              f"ratio {ours / theirs:5.2f}")  # fmt: skip
    graphs = engine.runner.graphs
    results["decode_graphs"] = 0 if graphs is None else len(graphs.captured)
    timed = [b for b in batches if b >= DEVICE_TARGET_FROM_BATCH]
    results["targets"] = {f"ratio_batch_{b}": f">= {DEVICE_TARGET_RATIO}" for b in timed}
    results["targets_met"] = {
        f"ratio_batch_{b}": results["batches"][str(b)]["ratio"] >= DEVICE_TARGET_RATIO
        for b in timed
    }
    print(json.dumps(results))


if __name__ == "__main__":
    main()
