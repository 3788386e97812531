"""Seesaw's offline group on one job, mode by mode: the same requests through the same 2-worker
group (`services/offline/group.py`) in each configuration the paper compares.

    python bench/seesaw.py [--requests 500] [--model tiny] [--buffer-slots 64] [--decode-slots 16]

Lengths come from the Azure conversation trace, scaled to the model (`--scale`, default 1/16 of
the prompt and output lengths, at least 1 token each, within `--max-len`). Modes:

- `seesaw`: pipeline-parallel prefill, tensor-parallel decode, transition-minimizing schedule;
- `tp`, `pp`: one sharding for both stages (pure tensor / pure pipeline parallel), prefill first
  (vLLM's default);
- `prefill_first` (prefill-prioritised interleaving), `decode_first`: Seesaw's shardings under
  the other two schedules.

The simulator's offline mode (`python -m loadgen.sim offline`) compares them on the A100/H100
profiles, over NVLink or the paper's PCIe (`--hardware a100-80gb-pcie`).

For each mode: output tokens per second, stage transitions, time in prefill, in decode and
blocked on the KV re-shard (swap-outs landing, swap-ins; both weight shardings stay resident, so
a re-shard moves no weights here), and greedy outputs equal to every other mode's. Each mode runs
`--rounds` times, the order reversed every other round (no mode always first on a warming
machine); its best round counts. Target: seesaw >= 1.2x the best of the others.

NOTE: Seesaw's gain comes from devices whose decode is bound by memory bandwidth, where tensor
parallelism multiplies it, and whose prefill pays for tensor parallelism's all-reduces. Two CPU
worker processes share one memory bus, and on a small model a gloo all-reduce (two per layer in
TP) costs more than the compute it splits, so pure PP tends to win here: the target is not
expected to be met, and the JSON says why (`why_not_here`); docs/simulator.md's offline table is
the GPU case, and `simulated_a100_pcie_seesaw_over_best_other` carries its figure (simulated,
not measured: 8 A100s on PCIe, `python -m loadgen.sim offline --hardware a100-80gb-pcie`), with
the same target. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.model.default import default_model_path  # noqa: E402
from loadgen.sim.offline import simulated_gain  # noqa: E402
from loadgen.traces import read_azure_csv, shared_dir  # noqa: E402
from services.offline.group import JobStats, OfflineGroup  # noqa: E402
from services.offline.options import MODES  # noqa: E402

TARGET = 1.2


def job(num: int, scale: float, max_len: int, vocab: int) -> tuple[list[list[int]], list[int]]:
    rows = read_azure_csv(shared_dir() / "traces" / "AzureLLMInferenceTrace_conv.csv")
    prompts, outputs = [], []
    for i, row in enumerate(rows):
        if i == num:
            break
        p = max(1, int(row.input_len * scale))
        o = max(1, int(row.output_len * scale))
        p = min(p, max_len - 1)
        o = min(o, max_len - p)
        prompts.append([(i * 31 + j * 7) % (vocab - 10) + 5 for j in range(p)])
        outputs.append(o)
    return prompts, outputs


def mode_row(stats: JobStats) -> dict[str, float]:
    return {
        "tokens_per_s": round(stats.num_tokens / stats.wall_s, 1),
        "wall_s": round(stats.wall_s, 3),
        "num_transitions": stats.num_transitions,
        "num_prefills": stats.num_prefills,
        "num_decode_steps": stats.num_decode_steps,
        "prefill_s": round(stats.prefill_s, 3),
        "decode_s": round(stats.decode_s, 3),
        "reshard_wait_s": round(stats.swap_s, 3),
    }


# What the JSON says when Seesaw misses its target on the CPU group.
WHY_NOT_HERE = (
    "2 CPU worker processes share one memory bus, and on a small model a gloo all-reduce (two "
    "per layer in tensor parallel) costs more than the compute it splits: tensor-parallel decode "
    "gains no bandwidth and pure pipeline parallel avoids the all-reduces; docs/simulator.md's "
    "offline table shows the GPU case"
)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--scale", type=float, default=1 / 16)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--buffer-slots", type=int, default=64)
    ap.add_argument("--decode-slots", type=int, default=16)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-prefill-tokens", type=int, default=2048, help="tokens per prefill")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    path = default_model_path(args.model)
    from common.config import ModelConfig

    vocab = ModelConfig.from_folder(path).vocab_size
    prompts, max_tokens = job(args.requests, args.scale, args.max_len, vocab)
    results: dict[str, dict[str, float]] = {}
    outputs_of: dict[str, list[list[int]]] = {}
    slots = {"num_buffer_slots": args.buffer_slots, "num_decode_slots": args.decode_slots}
    with OfflineGroup(path, 2, max_len=args.max_len, **slots) as group:
        group.generate(prompts[:4], max_tokens[:4])  # warm-up: first-call costs out of the way
        for r in range(args.rounds):
            for mode in args.modes if r % 2 == 0 else args.modes[::-1]:
                outputs, stats = group.generate(prompts, max_tokens, mode, args.max_prefill_tokens)
                outputs_of.setdefault(mode, outputs)
                assert outputs == outputs_of[mode], f"{mode}: round {r} differs"
                row = mode_row(stats)
                print(f"round {r} {mode:>14}: {row}", flush=True)
                if row["tokens_per_s"] > results.get(mode, {}).get("tokens_per_s", 0):
                    results[mode] = row
    others = {m: r["tokens_per_s"] for m, r in results.items() if m != "seesaw"}
    best_other = max(others, key=others.__getitem__) if others else None
    ratio = (
        results["seesaw"]["tokens_per_s"] / others[best_other]
        if best_other and "seesaw" in results
        else 0.0
    )
    first = next(iter(outputs_of.values()))
    # The GPU case, simulated (not measured): 8 A100s on PCIe 4.0 x8, the paper's PCIe system.
    simulated = round(simulated_gain("a100-80gb-pcie"), 3)
    summary = {
        "bench": "seesaw",
        "model": args.model,
        "requests": len(prompts),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "loadavg": os.getloadavg()[0],
        },  # fmt: skip
        "modes": results,
        "best_other": best_other,
        "seesaw_over_best_other": round(ratio, 3),
        "simulated_a100_pcie_seesaw_over_best_other": simulated,
        "targets": {
            "seesaw_over_best_other": TARGET,
            "outputs_equal": True,
            "simulated_a100_pcie_seesaw_over_best_other": TARGET,
        },  # fmt: skip
        "targets_met": {
            "seesaw_over_best_other": ratio >= TARGET,
            "simulated_a100_pcie_seesaw_over_best_other": simulated >= TARGET,
            "outputs_equal": all(o == first for o in outputs_of.values()),
        },
        "why_not_here": None if ratio >= TARGET else WHY_NOT_HERE,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
