"""Performance model: how long a prefill, a decode step or a KV transfer takes on a machine type.

Built the way Splitwise built its simulator's model (§V-B): piecewise-linear interpolation through
profiled points. Prefill time is a function of the batch's total prompt tokens (median over the
repeats of each `prompt_size * batch_size`); decode-step time is a function of the batch size,
from the batch sweep at one context (`decode_context`: 512 tokens in the Splitwise table). Both
extrapolate linearly past the last profiled point. A mixed iteration (prompts and decodes in one
batch) costs the prefill of all its tokens times a small interference factor, as in the Splitwise
simulator.

The profile table is Splitwise's `splitwise_perf_model.csv` (`loadgen.sim.designs.profile_path`
finds it; columns `model, hardware, prompt_size, batch_size, token_size, ..., prompt_time,
token_time, ..., tensor_parallel`, times in milliseconds); `bench/profile.py` writes the same
table for PhaseMesh's own engine.
"""

from __future__ import annotations

import bisect
import csv
import os
import statistics
from collections import defaultdict
from dataclasses import dataclass
from enum import StrEnum

# The profiled context length of the batch-size sweep in the Splitwise table.
PROFILED_DECODE_CONTEXT = 512


@dataclass(frozen=True)
class PiecewiseLinear:
    """y(x) through sorted knots; linear extrapolation from the end segments, never below 0."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.xs) != len(self.ys) or len(self.xs) < 2:
            raise ValueError("piecewise-linear: need at least two knots and equal-length xs, ys")
        if any(b <= a for a, b in zip(self.xs, self.xs[1:], strict=False)):
            raise ValueError("piecewise-linear: xs must be strictly increasing")

    def __call__(self, x: float) -> float:
        i = bisect.bisect_right(self.xs, x) - 1
        i = min(max(i, 0), len(self.xs) - 2)
        x0, x1 = self.xs[i], self.xs[i + 1]
        y0, y1 = self.ys[i], self.ys[i + 1]
        return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))

    @classmethod
    def fit(cls, points: dict[float, list[float]]) -> PiecewiseLinear:
        """Knots at the median of each x's samples, made non-decreasing (more work is never
        faster; the profile's small dips are measurement noise)."""
        xs = sorted(points)
        ys: list[float] = []
        for x in xs:
            y = statistics.median(points[x])
            ys.append(max(y, ys[-1]) if ys else y)
        return cls(tuple(float(x) for x in xs), tuple(ys))


@dataclass(frozen=True)
class PerfModel:
    """Iteration times (seconds) of one machine type running one model."""

    prefill_s_by_tokens: PiecewiseLinear
    decode_s_by_batch: PiecewiseLinear
    mixed_interference: float = 1.1

    def prefill_s(self, num_batch_tokens: int) -> float:
        """One prompt-only iteration over `num_batch_tokens` prompt tokens."""
        return self.prefill_s_by_tokens(num_batch_tokens)

    def decode_s(self, batch_size: int) -> float:
        """One decode-only iteration generating one token for each of `batch_size` requests."""
        return self.decode_s_by_batch(batch_size)

    def iteration_s(self, num_prefill_tokens: int, num_decodes: int) -> float:
        """Any iteration: decode-only, prompt-only, or mixed (each decode adds one batch token)."""
        if num_prefill_tokens == 0:
            return self.decode_s(num_decodes)
        if num_decodes == 0:
            return self.prefill_s(num_prefill_tokens)
        return self.prefill_s(num_prefill_tokens + num_decodes) * self.mixed_interference


def read_profile_points(
    path: str | os.PathLike[str],
    model: str,
    hardware: str,
    tensor_parallel: int,
    decode_context: int = PROFILED_DECODE_CONTEXT,
) -> tuple[dict[float, list[float]], dict[float, list[float]]]:
    """(prefill ms by batch tokens, decode ms by batch size) from a Splitwise-format profile; the
    decode points are the rows whose `prompt_size` is `decode_context`."""
    prefill: dict[float, list[float]] = defaultdict(list)
    decode: dict[float, list[float]] = defaultdict(list)
    with open(path, encoding="utf-8", newline="") as rows:
        for row in csv.DictReader(rows):
            if (row["model"], row["hardware"]) != (model, hardware):
                continue
            if int(row["tensor_parallel"]) != tensor_parallel:
                continue
            prompt_size, batch_size = int(row["prompt_size"]), int(row["batch_size"])
            prefill[prompt_size * batch_size].append(float(row["prompt_time"]))
            # NOTE: only the batch sweep (fixed context) feeds the decode curve; the prompt-size
            # sweep at batch 1 would put several contexts on one x.
            if prompt_size == decode_context:
                decode[batch_size].append(float(row["token_time"]))
    if not prefill or len(decode) < 2:
        raise ValueError(
            f"{path}: no profile rows for {model} on {hardware} with TP={tensor_parallel} "
            f"(and a batch sweep at prompt size {decode_context})"
        )
    return prefill, decode


def load_perf_model(
    path: str | os.PathLike[str],
    model: str,
    hardware: str,
    tensor_parallel: int,
    mixed_interference: float = 1.1,
    decode_context: int = PROFILED_DECODE_CONTEXT,
) -> PerfModel:
    """Fit a `PerfModel` for one (model, hardware, tensor parallelism) from a profile CSV."""
    prefill_ms, decode_ms = read_profile_points(
        path, model, hardware, tensor_parallel, decode_context
    )
    to_s = {x: [v / 1000.0 for v in vs] for x, vs in prefill_ms.items()}
    decode_s = {x: [v / 1000.0 for v in vs] for x, vs in decode_ms.items()}
    return PerfModel(PiecewiseLinear.fit(to_s), PiecewiseLinear.fit(decode_s), mixed_interference)


class TransferMode(StrEnum):
    """How KV moves from a prompt machine to a token machine (Splitwise §IV-C)."""

    SERIALIZED = "serialized"  # after the prefill, all at once: grows with prompt size
    LAYERWISE = "layerwise"  # overlapped with the prefill, one layer at a time: constant residual
    AUTO = "auto"  # whichever is shorter for this prompt, as Splitwise picks per batch


@dataclass(frozen=True)
class KVTransferModel:
    """Visible (non-overlapped) KV-transfer time between a prompt and a token machine."""

    bandwidth_bytes_s: float
    kv_bytes_per_token: int
    layerwise_residual_s: float
    mode: TransferMode = TransferMode.AUTO

    def __post_init__(self) -> None:
        if self.bandwidth_bytes_s <= 0 or self.kv_bytes_per_token <= 0:
            raise ValueError("kv transfer: bandwidth and bytes per token must be positive")

    def serialized_s(self, num_tokens: int) -> float:
        return num_tokens * self.kv_bytes_per_token / self.bandwidth_bytes_s

    def visible_s(self, num_tokens: int) -> float:
        """Time after the prefill ends until the token machine holds the request's KV."""
        if self.mode is TransferMode.SERIALIZED:
            return self.serialized_s(num_tokens)
        if self.mode is TransferMode.LAYERWISE:
            return self.layerwise_residual_s
        return min(self.serialized_s(num_tokens), self.layerwise_residual_s)


def mean_abs_pct_error(
    model: PerfModel, path: str | os.PathLike[str], key: tuple[str, str, int]
) -> float:
    """MAPE of the fitted prefill curve against every profile row (a fit sanity check)."""
    prefill_ms, _ = read_profile_points(path, *key)
    errors = [
        abs(model.prefill_s(int(x)) * 1000.0 - v) / v for x, vs in prefill_ms.items() for v in vs
    ]
    return sum(errors) / len(errors)


def memory_bound_s(num_bytes: float, bandwidth_bytes_s: float, efficiency: float) -> float:
    """Time to stream `num_bytes` at `efficiency` of a memory's bandwidth: decode attention,
    which reads each request's KV once per step (Lamina §2.2: memory-bound at any batch size,
    above 70% of bandwidth in its Fig. 3)."""
    if bandwidth_bytes_s <= 0 or not 0 < efficiency <= 1:
        raise ValueError("memory-bound time: need a positive bandwidth and 0 < efficiency <= 1")
    return num_bytes / (bandwidth_bytes_s * efficiency)


@dataclass(frozen=True)
class DenseDecodeModel:
    """The non-attention part of a decode step (Lamina's "model" part: projections, MLP, LM head)
    by batch size: through the profile's batch sweep less each point's attention, then linear
    at `slope_past_s` per request past the largest profiled batch."""

    by_batch: PiecewiseLinear
    slope_past_s: float

    def __call__(self, batch_size: float) -> float:
        last = self.by_batch.xs[-1]
        if batch_size <= last:
            return self.by_batch(batch_size)
        return self.by_batch(last) + (batch_size - last) * self.slope_past_s


def dense_decode_model(
    decode: PerfModel, attention_s_per_request: float, slope_past_s: float | None = None
) -> DenseDecodeModel:
    """`decode`'s step less `attention_s_per_request` (one request's attention at the profile's
    context, e.g. `memory_bound_s` of its KV) per request, at each profiled batch size.
    `slope_past_s` None continues the last profiled segment's slope."""
    curve = decode.decode_s_by_batch
    ys: list[float] = []
    for x, y in zip(curve.xs, curve.ys, strict=True):
        # NOTE: never below a tenth of the step: the attention estimate is a bound, not a fit.
        dense = max(y - x * attention_s_per_request, 0.1 * y)
        ys.append(max(dense, ys[-1]) if ys else dense)  # more requests are never faster
    by_batch = PiecewiseLinear(curve.xs, tuple(ys))
    if slope_past_s is None:
        slope_past_s = (ys[-1] - ys[-2]) / (curve.xs[-1] - curve.xs[-2])
    return DenseDecodeModel(by_batch, slope_past_s)


@dataclass(frozen=True)
class NeoCostTables:
    """Neo's T_l, T_ga and T_ca (seconds, all layers) as interpolated tables: the
    `common.scheduling.neo_state.NeoCostModel` of one machine, model and offload tier."""

    linear_s_by_tokens: PiecewiseLinear  # T_l by batch tokens
    local_attention_s_by_context: PiecewiseLinear  # T_ga by the sub-batch's context tokens
    offload_attention_s_by_context: PiecewiseLinear  # T_ca, likewise

    def linear_s(self, num_tokens: int) -> float:
        return self.linear_s_by_tokens(num_tokens) if num_tokens > 0 else 0.0

    def local_attention_s(self, num_context_tokens: int) -> float:
        return self.local_attention_s_by_context(num_context_tokens) if num_context_tokens else 0.0

    def offload_attention_s(self, num_context_tokens: int) -> float:
        if num_context_tokens <= 0:
            return 0.0
        return self.offload_attention_s_by_context(num_context_tokens)


def proportional(seconds_per_unit: float) -> PiecewiseLinear:
    """y = seconds_per_unit * x: a bandwidth-bound stage (attention reads each KV byte once)."""
    return PiecewiseLinear((0.0, 1.0), (0.0, seconds_per_unit))


def neo_costs_from_profile(
    path: str | os.PathLike[str],
    key: tuple[str, str, int],
    kv_bytes_per_token: int,
    offload_bytes_s: float,
    decode_context: int = PROFILED_DECODE_CONTEXT,
    attention_path: str | os.PathLike[str] | None = None,
) -> NeoCostTables:
    """Neo's tables from a Splitwise-format profile (`key`: model, hardware, tensor parallel).

    - T_ga: the slope of decode time over context at batch 1 (the profile's context sweep): the
      time a decode step gains per context token is its local attention.
    - T_l: decode time at batch b (contexts `decode_context`) less T_ga of its b x context tokens,
      at b batch tokens; the prefill times above the largest decode batch (a prompt's attention is
      a small part of its prefill, so it stays in T_l).
    - T_ca: the offload tier reads each KV byte once: context x `kv_bytes_per_token` /
      `offload_bytes_s` (Neo profiles its CPU kernel).
    With `attention_path` (`bench/profile.py --attention`'s table), T_ga and T_ca are its
    measured `local` and `offload` rows instead (and `offload_bytes_s` is unused).
    """
    if offload_bytes_s <= 0 or kv_bytes_per_token <= 0:
        raise ValueError("neo costs: offload bandwidth and KV bytes per token must be positive")
    prefill_ms, decode_ms = read_profile_points(path, *key, decode_context=decode_context)
    if attention_path is not None:
        local, offload = read_attention_tables(attention_path, key[0], key[1])
    else:
        by_context = _batch1_decode_ms_by_context(path, key)
        lo, hi = min(by_context), max(by_context)
        local = proportional(max(0.0, (by_context[hi] - by_context[lo]) / (hi - lo)) / 1000.0)
        offload = proportional(kv_bytes_per_token / offload_bytes_s)
    linear: dict[float, list[float]] = {
        b: [v / 1000.0 - local(b * decode_context) for v in vs] for b, vs in decode_ms.items()
    }
    largest_batch = max(decode_ms)
    for tokens, vs in prefill_ms.items():
        if tokens > largest_batch:
            linear[tokens] = [v / 1000.0 for v in vs]
    return NeoCostTables(PiecewiseLinear.fit(linear), local, offload)


def read_attention_tables(
    path: str | os.PathLike[str], model: str, hardware: str
) -> tuple[PiecewiseLinear, PiecewiseLinear]:
    """(local, offload) decode-attention seconds by context tokens from `bench/profile.py
    --attention`'s CSV (`model, hardware, tier, batch_size, context_tokens, time_ms`)."""
    samples: dict[str, dict[float, list[float]]] = {"local": defaultdict(list)}
    samples["offload"] = defaultdict(list)
    with open(path, encoding="utf-8", newline="") as rows:
        for row in csv.DictReader(rows):
            if (row["model"], row["hardware"]) == (model, hardware) and row["tier"] in samples:
                samples[row["tier"]][float(row["context_tokens"])].append(
                    float(row["time_ms"]) / 1000.0
                )
    if any(len(points) < 2 for points in samples.values()):
        raise ValueError(f"{path}: need local and offload rows at 2+ contexts for {model}")
    return PiecewiseLinear.fit(samples["local"]), PiecewiseLinear.fit(samples["offload"])


def _batch1_decode_ms_by_context(
    path: str | os.PathLike[str], key: tuple[str, str, int]
) -> dict[float, float]:
    """Median decode-step ms at batch 1 by prompt size (the profile's context sweep)."""
    samples: dict[float, list[float]] = defaultdict(list)
    with open(path, encoding="utf-8", newline="") as rows:
        for row in csv.DictReader(rows):
            if (row["model"], row["hardware"], int(row["tensor_parallel"])) != key:
                continue
            if int(row["batch_size"]) == 1:
                samples[int(row["prompt_size"])].append(float(row["token_time"]))
    if len(samples) < 2:
        raise ValueError(f"{path}: no batch-1 context sweep for {key}")
    return {x: statistics.median(vs) for x, vs in samples.items()}
