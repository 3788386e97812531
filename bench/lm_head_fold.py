"""The final norm and LM head in the fused decode call, against the same engine computing them
after it (`compute_logits`): batch-1 decode steps alternating in one process.

    python bench/lm_head_fold.py [--model small] [--weight-dtypes float32 bfloat16 int8]
                                 [--rounds 7] [--tokens 48]

Per weight dtype two engines on the same model folder, one with its `FusedDecode.head` dropped
(the layers in one call, then the norm and the LM head as their own calls, as before the head
was folded in); each round runs one greedy generation of `tokens` on each, in turn, timing every
decode step. Reports each side's median step (microseconds), their difference (`saved_us`) and
ratio, and whether both generated the same tokens. The last line is one JSON object with
`targets` and `targets_met` (the fold never slower, the tokens equal).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from common.engine.core import LLMEngine
from common.model.default import default_model_path
from common.model.linear import pack_linears
from common.sampling_params import SamplingParams

PROMPT = list(range(11, 51))


def decode_steps_us(engine: LLMEngine, tokens: int) -> tuple[list[float], list[int]]:
    """One greedy generation: each decode step's microseconds and the generated tokens."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    engine.add_request("r", PROMPT, params)
    times, out = [], []
    while engine.has_unfinished():
        start = time.perf_counter()
        step = engine.step()
        times.append((time.perf_counter() - start) * 1e6)
        out += step[0].new_token_ids
    return times[1:], out  # the first step is the prefill


def dtype_row(path: str, dtype: str, rounds: int, tokens: int) -> dict:
    sides = {}
    for name in ("folded", "separate"):
        engine = LLMEngine.from_path(path, num_blocks=256)
        if dtype != "float32":
            pack_linears(engine.model, weight_dtype=dtype)
        decode_steps_us(engine, 4)  # builds the fused layers
        fused = engine.runner._fused
        if fused is None or fused.head is None:
            return {"skipped": "no fused LM head here (extension or weights)"}
        if name == "separate":
            fused.head = None
        sides[name] = engine
    steps: dict[str, list[float]] = {name: [] for name in sides}
    outputs: dict[str, list[int]] = {}
    for _ in range(rounds):
        for name, engine in sides.items():
            times, outputs[name] = decode_steps_us(engine, tokens)
            steps[name] += times
    folded, separate = (statistics.median(steps[n]) for n in ("folded", "separate"))
    return {
        "folded_us": round(folded, 1),
        "separate_us": round(separate, 1),
        "saved_us": round(separate - folded, 1),
        "separate_over_folded": round(separate / folded, 4),
        "same_tokens": outputs["folded"] == outputs["separate"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--weight-dtypes", nargs="+", default=["float32", "bfloat16", "int8"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    path = str(default_model_path(args.model))
    rows = {}
    for dtype in args.weight_dtypes:
        rows[dtype] = row = dtype_row(path, dtype, args.rounds, args.tokens)
        print(f"{dtype}: {row}", flush=True)
    ran = [r for r in rows.values() if "skipped" not in r]
    targets = {"separate_over_folded": 1.0, "same_tokens": True}
    met = {
        "separate_over_folded": bool(ran) and all(r["separate_over_folded"] >= 1.0 for r in ran),
        "same_tokens": bool(ran) and all(r["same_tokens"] for r in ran),
    }
    print(json.dumps({"model": args.model, "threads": torch.get_num_threads(), "rows": rows,
                      "targets": targets, "targets_met": met}))  # fmt: skip


if __name__ == "__main__":
    main()
