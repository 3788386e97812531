"""Profile PhaseMesh's own engine into the Splitwise table (the `../shared/perf/*.csv` format).

    python bench/profile.py [--model tiny] [--decode engine|mesh|http://HOST:PORT] [--out FILE]

One row per (prompt size P, batch size B, repeat), with the GPU profiles' columns:

- `prompt_time`: one prefill forward over B prompts of P tokens (a prompt engine's batch), run in
  this process with the engines' model runner (ms).
- `token_time`: one decode iteration at batch B, contexts from P to P + token_size (ms), measured
  where `--decode` says:
    engine  in this process, local paged attention (a mixed engine's decode step);
    mesh    a launched mesh (`services.launch`: one prompt engine, one token engine and `--shards`
            attention shards): the steady gap between the tokens of B concurrent requests, shard
            round trips included, as the mesh's own client sees it;
    URL     a running server's OpenAI API (`serve run deploy/local.yaml`, say): the same gap as
            its HTTP clients see it, streaming through the router and Serve's proxy on the same
            cores as the engines (loadgen's HTTP client sends the requests).
- `e2e_time`: prompt_time + token_size x token_time. Powers are 0 (not recorded), tensor_parallel 1.

The remote decodes and their steady window are `bench/remote_decode.py`.

`PHASEMESH_PERF_PROFILE=FILE` points the simulator at the table (`loadgen/sim/designs.py`);
`--hardware` names the machine in it. The last line is one JSON object: the file, its row count,
and the median prefill and decode times by batch size.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

# NOTE: this file's name shadows the stdlib `profile` (cProfile imports it, and torch imports
# cProfile): keep bench/ off the import path; the repository root goes on it instead.
_BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _BENCH]
sys.path.insert(0, os.path.dirname(_BENCH))

from bench.remote_decode import HttpDecode, MeshDecode, RemoteDecode, remote_decode_ms  # noqa: E402
from common.engine.core import LLMEngine  # noqa: E402
from common.model.default import PRESETS, default_model_path  # noqa: E402
from common.scheduling.batching import Batch, Phase, Sequence  # noqa: E402

COLUMNS = (
    "model", "hardware", "prompt_size", "batch_size", "token_size", "peak_power",
    "average_power", "prompt_time", "token_time", "e2e_time", "tensor_parallel",
)  # fmt: skip
FIRST_ID = 8  # prompt ids start past the special tokens


@dataclass(frozen=True)
class Cell:
    """One profiled configuration: B prompts of P tokens, then decode at batch B."""

    prompt_size: int
    batch_size: int


def cells(prompt_sizes: list[int], batch_sizes: list[int], max_batch_tokens: int) -> list[Cell]:
    return [Cell(p, b) for p in prompt_sizes for b in batch_sizes if p * b <= max_batch_tokens]


WARM_UP, WARM_UP_STEPS = Cell(16, 2), 4  # run once before the grid


def kv_blocks(grid: list[Cell], extra_tokens: int, block_size: int = 16) -> int:
    """KV blocks for the largest batch of the grid, each request `extra_tokens` past its prompt."""
    per_request = [-(-(c.prompt_size + extra_tokens) // block_size) for c in grid]
    return max(c.batch_size * n for c, n in zip(grid, per_request, strict=True))


def prompt_ids(cell: Cell, vocab: int, salt: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(cell.prompt_size * 7919 + cell.batch_size * 31 + salt)
    shape = (cell.batch_size, cell.prompt_size)
    return torch.randint(FIRST_ID, vocab, shape, generator=gen).tolist()


class LocalRunner:
    """The engines' `ModelRunner` in this process: timed prefill batches and decode steps."""

    def __init__(self, model_path: str, num_blocks: int) -> None:
        self.engine = LLMEngine.from_path(model_path, num_blocks=num_blocks)
        self.vocab = self.engine.model_config.vocab_size

    def run(self, cell: Cell, decode_steps: int, salt: int) -> tuple[float, list[float]]:
        """(prefill ms, per-step decode ms) of one batch; `decode_steps` may be 0."""
        blocks = self.engine.blocks
        prompts = prompt_ids(cell, self.vocab, salt)
        seqs = [Sequence(f"p{i}", cell.prompt_size) for i in range(cell.batch_size)]
        token_ids = {s.req_id: list(p) for s, p in zip(seqs, prompts, strict=True)}
        for seq in seqs:
            blocks.allocate(seq.req_id, cell.prompt_size + decode_steps + 1)
        try:
            prefill_ms = self._timed_step(Batch(Phase.PREFILL, seqs), token_ids)
            steps = [self._timed_step(Batch(Phase.DECODE, seqs), token_ids)
                     for _ in range(decode_steps)]  # fmt: skip
            return prefill_ms, steps
        finally:
            for seq in seqs:
                blocks.free(seq.req_id)

    @torch.inference_mode()
    def _timed_step(self, batch: Batch, token_ids: dict[str, list[int]]) -> float:
        runner = self.engine.runner
        start = time.perf_counter()
        logits = runner.run(runner.prepare(batch, token_ids))
        sampled = logits.argmax(dim=-1).tolist()  # greedy, as the replays sample
        elapsed_ms = (time.perf_counter() - start) * 1e3
        for seq, token in zip(batch.seqs, sampled, strict=True):
            token_ids[seq.req_id].append(token)
            seq.num_computed, seq.num_tokens = seq.num_tokens, seq.num_tokens + 1
        return elapsed_ms


def profile_rows(
    args: argparse.Namespace, local: LocalRunner, remote: RemoteDecode | None
) -> Iterator[dict[str, object]]:
    """Profile every cell `--repeats` times (repeats outermost, so slow drift hits all cells)."""
    grid = cells(args.prompt_sizes, args.batch_sizes, args.max_batch_tokens)
    local.run(WARM_UP, WARM_UP_STEPS, salt=-1)  # first-call allocations, kernel dispatch
    allowance = 8
    bar = tqdm(total=args.repeats * len(grid), unit="cell", dynamic_ncols=True)
    for repeat in range(args.repeats):
        for cell in grid:
            steps = args.token_size if remote is None else 0
            prompt_ms, step_ms = local.run(cell, steps, salt=repeat)
            if remote is None:
                token_ms = statistics.median(step_ms)
            else:
                prompts = prompt_ids(cell, local.vocab, salt=repeat)
                token_ms, allowance = remote_decode_ms(remote, prompts, args.token_size, allowance)
            bar.update(1)
            bar.set_postfix(P=cell.prompt_size, B=cell.batch_size, decode_ms=f"{token_ms:.1f}")
            yield row(args, cell, prompt_ms, token_ms)
    bar.close()


def row(
    args: argparse.Namespace, cell: Cell, prompt_ms: float, token_ms: float
) -> dict[str, object]:
    return {
        "model": args.model_name, "hardware": args.hardware, "prompt_size": cell.prompt_size,
        "batch_size": cell.batch_size, "token_size": args.token_size, "peak_power": 0.0,
        "average_power": 0.0, "prompt_time": round(prompt_ms, 4), "token_time": round(token_ms, 4),
        "e2e_time": round(prompt_ms + args.token_size * token_ms, 4), "tensor_parallel": 1,
    }  # fmt: skip


def write_table(
    path: Path, rows: list[dict[str, object]], columns: tuple[str, ...] = COLUMNS
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as out:
        writer = csv.DictWriter(out, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def summary(path: Path, rows: list[dict[str, object]]) -> dict[str, object]:
    """Medians over repeats: prefill ms by batch tokens, decode ms by prompt size and batch."""
    prefill: dict[int, list[float]] = {}
    decode: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        p, b = int(r["prompt_size"]), int(r["batch_size"])  # type: ignore[call-overload]
        prefill.setdefault(p * b, []).append(float(r["prompt_time"]))  # type: ignore[arg-type]
        by_batch = decode.setdefault(str(p), {})
        by_batch.setdefault(str(b), []).append(float(r["token_time"]))  # type: ignore[arg-type]
    med: Callable[[list[float]], float] = lambda v: round(statistics.median(v), 3)  # noqa: E731
    return {
        "out": str(path),
        "model": rows[0]["model"] if rows else "",
        "hardware": rows[0]["hardware"] if rows else "",
        "rows": len(rows),
        "prefill_ms_by_tokens": {str(x): med(v) for x, v in sorted(prefill.items())},
        "decode_ms_by_prompt_and_batch": {
            p: {b: med(v) for b, v in by_batch.items()} for p, by_batch in decode.items()
        },
    }


ATTENTION_COLUMNS = ("model", "hardware", "tier", "batch_size", "context_tokens", "time_ms")


def attention_rows(
    args: argparse.Namespace, engine: LLMEngine, contexts: list[int]
) -> Iterator[dict[str, object]]:
    """Neo's T_ga and T_ca tables (`--attention`): one decode-attention call per layer over a
    batch of `--attention-batch` requests holding `context` tokens in all, for the engine's own
    backend (`local`) and the shards' CPU kernel at one thread (`offload`, per shard: a group of
    S shards splits the KV heads S ways). Times are all layers' (ms), median of the repeats."""
    from common.attention import select_backend
    from common.attention.cpu_kernel import CpuKernelAttention, kernel_available
    from services.engine.cost_probe import attention_s

    tiers = {"local": select_backend("auto")}
    if kernel_available():
        tiers["offload"] = CpuKernelAttention(num_threads=1)
    for context in contexts:
        for tier, backend in tiers.items():
            held, seconds = attention_s(
                backend, engine.model_config, args.attention_batch, context, args.repeats
            )
            yield {"model": args.model_name, "hardware": args.hardware, "tier": tier,
                   "batch_size": args.attention_batch, "context_tokens": held,
                   "time_ms": round(seconds * 1e3, 4)}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", help="a default-model preset or a folder")
    parser.add_argument("--model-name", default=None, help="the table's `model` (default: --model)")
    parser.add_argument("--decode", default="engine", help="engine, mesh, or a server URL")
    parser.add_argument("--shards", type=int, default=2, help="attention shards with --decode mesh")
    parser.add_argument("--hardware", default=None, help="the table's `hardware` column")
    parser.add_argument("--prompt-sizes", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--max-batch-tokens", type=int, default=8192, help="skip larger P x B")
    parser.add_argument("--token-size", type=int, default=32, help="decode steps per cell")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (engines use 1)")
    parser.add_argument("--out", default=None, help="CSV path (default: results/profile/...)")
    parser.add_argument("--attention", type=int, nargs="*", default=None,
                        help="also write Neo's attention tables at these context tokens "
                        "(no values: 256 .. 16384) to <out>-attention.csv")  # fmt: skip
    parser.add_argument(
        "--attention-batch", type=int, default=8, help="requests per --attention call"
    )
    args = parser.parse_args(argv)
    args.model_name = args.model_name or Path(args.model).name
    if args.hardware is None:
        mode = args.decode if args.decode in ("engine", "mesh") else "http"
        args.hardware = f"cpu-{mode}" + (f"-{args.shards}shards" if mode == "mesh" else "")
    return args


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_path = str(default_model_path(args.model) if args.model in PRESETS else args.model)
    grid = cells(args.prompt_sizes, args.batch_sizes, args.max_batch_tokens)
    # The warm-up cell counts too: a grid of one small cell held less than it needs.
    steps = max(args.token_size, WARM_UP_STEPS) + 2
    local = LocalRunner(model_path, num_blocks=kv_blocks([*grid, WARM_UP], steps))
    remote: RemoteDecode | None = None
    if args.decode == "mesh":
        # Shards reserve each request's whole length; the join allowance may reach 1024 tokens.
        blocks = kv_blocks(grid, args.token_size + 1024)
        remote = MeshDecode(model_path, args.shards, num_blocks=blocks)
    elif args.decode != "engine":
        remote = HttpDecode(args.decode, local.vocab)
    try:
        rows = list(profile_rows(args, local, remote))
    finally:
        if remote is not None:
            remote.close()
    default = Path("results/profile") / f"{args.model_name}-{args.hardware}.csv"
    path = Path(args.out) if args.out else default
    write_table(path, rows)
    result = summary(path, rows)
    if args.attention is not None:
        contexts = args.attention or [256, 1024, 4096, 16384]
        attention = list(attention_rows(args, local.engine, contexts))
        write_table(path.with_name(path.stem + "-attention.csv"), attention, ATTENTION_COLUMNS)
        result["attention_ms_by_tier_and_context"] = {
            f"{r['tier']}@{r['context_tokens']}": r["time_ms"] for r in attention
        }
    print(f"wrote {len(rows)} rows to {path} ({args.model_name} on {args.hardware})")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
