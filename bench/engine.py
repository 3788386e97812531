"""Decode throughput: PhaseMesh's engine against `transformers` generate, same weights, same run.

    python bench/engine.py [--model PATH] [--batches 1 8 32] [--repeats 3]

Per-step decode time is measured by differencing two generation lengths (64 and 16 new tokens)
so that prefill cancels out; tokens/s = batch / step time. Prompts have mixed lengths (16-128).
The last line is one JSON object with both sides and their ratio per batch size.
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

from common.engine.core import LLMEngine
from common.model.default import default_model_path
from common.sampling import SamplingParams

LONG, SHORT = 64, 16


def prompts_for(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 129, (batch,), generator=gen).tolist()
    return [torch.randint(8, vocab, (n,), generator=gen).tolist() for n in lengths]


def engine_seconds(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> float:
    # Token ids only, like transformers' generate: no text (a server's text is the router's job).
    params = SamplingParams(
        max_tokens=new_tokens, temperature=0.0, ignore_eos=True, detokenize=False
    )
    start = time.perf_counter()
    engine.generate(prompts, params)
    return time.perf_counter() - start


def hf_seconds(model, prompts: list[list[int]], new_tokens: int) -> float:  # type: ignore[no-untyped-def]
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):  # left padding, as batched generation needs
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return time.perf_counter() - start


def decode_tokens_per_s(runs: dict[str, Callable], prompts: list[list[int]], repeats: int) -> dict:
    """Median over repeats of batch / per-step time for each side; per-step time comes from two
    lengths. The sides alternate within every repeat, so a busy spell on a shared machine hits
    both rather than one."""
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            step = (run(prompts, LONG) - run(prompts, SHORT)) / (LONG - SHORT)
            rates[name].append(len(prompts) / step)
    return {name: statistics.median(r) for name, r in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    # NOTE: run as a script, Python puts bench/ first on sys.path, where bench/profile.py would
    # shadow the standard library's `profile` (which cProfile, imported by transformers, needs).
    if sys.path[0] == str(Path(__file__).resolve().parent):
        sys.path[0] = str(Path(__file__).resolve().parents[1])
    from transformers import LlamaForCausalLM

    path = args.model or str(default_model_path())
    engine = LLMEngine.from_path(path, num_blocks=2048)
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = engine.model_config.vocab_size
    results = {"model": path, "threads": torch.get_num_threads(), "batches": {}}
    for batch in args.batches:
        prompts = prompts_for(batch, vocab)
        runs = {
            "engine": lambda p, n: engine_seconds(engine, p, n),
            "transformers": lambda p, n: hf_seconds(hf, p, n),
        }
        rates = decode_tokens_per_s(runs, prompts, args.repeats)
        ours, theirs = rates["engine"], rates["transformers"]
        results["batches"][str(batch)] = {
            "engine_tok_s": round(ours, 1),
            "transformers_tok_s": round(theirs, 1),
            "ratio": round(ours / theirs, 2),
        }
        print(f"batch {batch:3d}: engine {ours:9.1f} tok/s  transformers {theirs:9.1f} tok/s  "
              f"ratio {ours / theirs:5.2f}")  # fmt: skip
    print(json.dumps(results))


if __name__ == "__main__":
    main()
