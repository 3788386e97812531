"""Paired A/B of two builds of the csrc decode-attention kernel, in one process.

On a shared machine the load comes and goes, so timings from two separate runs differ by more
than the few percent a kernel change is worth. This tool builds each source tree as its own
module (`phasemesh_attention_kernel_<tag>`, its own nanobind domain and C++ namespace, so both
load side by side), then times the two kernels call by call, alternating which goes first, on the
same KV sets (rotated over 256 MiB, so nothing is timed from cache), with the C read probe after
each pair. It prints medians and minima of kernel/read-probe per build and the speed ratio b/a.

The kernel that runs second in a pair finds part of the KV set the first one just read still in
the last-level cache, so single calls fall in two modes by their order. Medians are therefore
taken over pairs of consecutive iterations, one `ab` and one `ba` (each KV set sees both orders),
each pair's time per tag the mean of its two calls; b's speedup is the median of the pairs' a/b.
(A median over single calls, one tag first once more often than the other, picked the slow mode
for one and the fast for the other: two identical builds differed by far more than a kernel
change is worth; docs/benchmarks/kernels.md.)

With `--clock thread` and 1 thread the kernel runs on the calling thread and is timed in CPU
time, which leaves out the time the scheduler gives to other processes: under load two identical
builds then agree far more closely than their wall-clock medians do.

    PYTHONPATH=. .venv/bin/python bench/attention_ab.py BASE_CSRC_DIR csrc \
        --shapes gqa_b32,mha_b32 --dtypes float32 --threads 1 --clock thread
    (BASE_CSRC_DIR: e.g. `git archive main csrc | tar -x -C /tmp/base`, then /tmp/base/csrc)

`--batch 4 --rotation-mib 8` times the kernels from cache (their compute, not the memory); the
read probe then still reads memory, so only b/a means anything there.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# NOTE: before torch loads its OpenMP runtime, as bench/attention.py (its NOTE says why): the read
# probe between the kernels' calls runs on OpenMP, whose threads spin after it by default, and at
# as many threads as cores one of them held the core the next kernel call's second thread needed.
# Two identical builds then differed by 1.18x at 2 threads. The JSON names the policy.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import torch  # noqa: E402
from torch.utils.dlpack import to_dlpack  # noqa: E402

if sys.path[0] == str(Path(__file__).resolve().parent):  # run as a script: the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from common.host_memory import huge_page_copy  # noqa: E402

BLOCK_SIZE = 16
ROTATION_BYTES = 256 << 20
SHAPES = {  # batch, context, q heads, kv heads, head_dim (bench/attention.py's shapes)
    "gqa_b32": (32, 2048, 8, 2, 128),
    "mha_b32": (32, 2048, 4, 4, 128),
    "gqa_b1": (1, 32768, 8, 2, 128),
    "mha_b1": (1, 32768, 4, 4, 128),
    # Short contexts: many fragments a thread, where a fragment's first step weighs most.
    "gqa_b128_c512": (128, 512, 8, 2, 128),
    "mha_b128_c512": (128, 512, 4, 4, 128),
}
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time, "process": time.process_time}


def build(src: Path, tag: str, work: Path) -> None:
    """Builds `src` as module phasemesh_attention_kernel_<tag> into work/mod."""
    module = f"phasemesh_attention_kernel_{tag}"
    tree = work / f"src_{tag}"
    shutil.copytree(src, tree)
    cmake = (tree / "CMakeLists.txt").read_text()
    cmake = cmake.replace("kernel NB_STATIC", f"kernel_{tag} NB_STATIC NB_DOMAIN ab_{tag}")
    for call in ("target_compile_options(", "target_link_libraries(", "install(TARGETS "):
        cmake = cmake.replace(f"{call}phasemesh_attention_kernel ", f"{call}{module} ")
    (tree / "CMakeLists.txt").write_text(cmake)
    bindings = (tree / "bindings.cpp").read_text()
    bindings = bindings.replace(
        "NB_MODULE(phasemesh_attention_kernel,", f"NB_MODULE(phasemesh_attention_kernel_{tag},"
    )
    (tree / "bindings.cpp").write_text(bindings)
    out = work / f"build_{tag}"
    flags = [f"-DPython_EXECUTABLE={sys.executable}", f"-DCMAKE_CXX_FLAGS=-Dpm=pm_{tag}"]
    subprocess.run(
        ["cmake", "-S", tree, "-B", out, "-DCMAKE_BUILD_TYPE=Release", *flags],
        check=True,
        capture_output=True,
    )
    subprocess.run(["cmake", "--build", out, "-j2"], check=True, capture_output=True)
    (work / "mod").mkdir(exist_ok=True)
    for so in out.glob(f"phasemesh_attention_kernel_{tag}*.so"):
        shutil.copy(so, work / "mod")


def kv_sets(
    batch: int, context: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    gen: torch.Generator, rotation_bytes: float,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:  # fmt: skip
    """As many paged (K, V, shuffled block table) sets as cover `rotation_bytes`."""
    kv_bytes = 2 * batch * num_kv_heads * context * head_dim * dtype.itemsize
    num_blocks = batch * context // BLOCK_SIZE
    sets = []
    for _ in range(max(1, math.ceil(rotation_bytes / kv_bytes))):
        # On huge pages, as the engine's KV pool (common/host_memory.py).
        k = torch.randn(num_blocks, num_kv_heads, head_dim, BLOCK_SIZE, generator=gen).to(dtype)
        v = torch.randn(num_blocks, num_kv_heads, BLOCK_SIZE, head_dim, generator=gen).to(dtype)
        k, v = huge_page_copy(k), huge_page_copy(v)
        table = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(batch, -1)
        sets.append((k, v, table))
    return sets


def timed_calls(
    mods: dict, sets: list, q: torch.Tensor, lens: torch.Tensor, outs: dict,
    args: argparse.Namespace,
) -> dict[str, list[float]]:  # fmt: skip
    """Seconds of each call of build a, of b and of the read probe after each pair: two
    warm-up pairs, then whole ab/ba pairs, each KV set in turn run a first, then b (not one build
    always first on the same sets)."""
    kernels = {t: m.PagedDecodeKernel() for t, m in mods.items()}
    clock = CLOCKS[args.clock]
    times: dict[str, list[float]] = {"a": [], "b": [], "read": []}
    repeats = args.repeats + args.repeats % 2
    for i in range(repeats + 2):
        k, v, table = sets[i % len(sets)]
        shift = i // len(sets) if len(sets) % 2 == 0 else 0
        for tag in "ab" if (i + shift) % 2 == 0 else "ba":
            out, lse = outs[tag]
            args_in = [to_dlpack(x) for x in (q, k, v, table, lens)]
            start = clock()
            kernels[tag].decode(*args_in, None, to_dlpack(out), to_dlpack(lse), 0.088, 0, -1,
                                args.threads, args.isa)  # fmt: skip
            times[tag].append(clock() - start)
        start = clock()
        mods["a"].read_sum(mods["a"].probe, args.threads)
        times["read"].append(clock() - start)
    return times


def compare(shape: str, dtype: torch.dtype, mods: dict, args: argparse.Namespace) -> dict:
    batch, context, num_q_heads, num_kv_heads, head_dim = SHAPES[shape]
    batch = args.batch or batch
    gen = torch.Generator().manual_seed(0)
    kv_bytes = 2 * batch * num_kv_heads * context * head_dim * dtype.itemsize
    sets = kv_sets(batch, context, num_kv_heads, head_dim, dtype, gen, args.rotation_mib * 2**20)
    q = torch.randn(batch, num_q_heads, head_dim, generator=gen).to(dtype)
    lens = torch.full((batch,), context, dtype=torch.int32)
    outs = {
        t: (torch.empty(batch, num_q_heads, head_dim), torch.empty(batch, num_q_heads))
        for t in mods
    }
    times = timed_calls(mods, sets, q, lens, outs, args)
    read_bytes = mods["a"].probe.numel() * 4
    # The medians are over ab/ba pairs (the second call of a pair finds part of its set in cache).
    pairs = {
        name: [(x + y) / 2 for x, y in zip(ts[2::2], ts[3::2], strict=True)]
        for name, ts in times.items()
    }
    row = {}
    for stat, t in (
        ("median", {name: statistics.median(ts) for name, ts in pairs.items()}),
        ("min", {name: min(ts[2:]) for name, ts in times.items()}),
    ):
        for tag in "ab":
            row[f"{tag}_over_read_{stat}"] = round(kv_bytes / t[tag] / (read_bytes / t["read"]), 3)
    row["b_speedup_median"] = round(
        statistics.median(a / b for a, b in zip(pairs["a"], pairs["b"], strict=True)), 3
    )
    row["b_speedup_min"] = round(min(times["a"][2:]) / min(times["b"][2:]), 3)
    row["max_abs_diff"] = (outs["a"][0] - outs["b"][0]).abs().max().item()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("a", type=Path, help="baseline csrc directory")
    parser.add_argument("b", type=Path, help="variant csrc directory")
    parser.add_argument("--shapes", default="gqa_b32,mha_b32")
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="thread")
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument(
        "--rotation-mib",
        type=float,
        default=ROTATION_BYTES >> 20,
        help="KV bytes the calls rotate over; below the LLC (and with --batch) times from cache",
    )
    parser.add_argument("--batch", type=int, default=0, help="override every shape's batch")
    parser.add_argument("--isa", default="auto",
                        help="the kernel ISA both builds run (auto: the best this CPU has; "
                             "avx2 on an AVX-512 machine times the AVX2 path)")  # fmt: skip
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="attention_ab_"))
    try:
        for tag, src in (("a", args.a), ("b", args.b)):
            build(src, tag, work)
        run(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(work: Path, args: argparse.Namespace) -> None:
    sys.path.insert(0, str(work / "mod"))
    mods = {tag: importlib.import_module(f"phasemesh_attention_kernel_{tag}") for tag in "ab"}
    torch.set_num_threads(args.threads)
    mods["a"].probe = torch.ones(ROTATION_BYTES // 4)
    rows = {}
    for shape in args.shapes.split(","):
        for name in args.dtypes.split(","):
            rows[f"{shape}_{name}"] = compare(shape, getattr(torch, name), mods, args)
            print(shape, name, rows[f"{shape}_{name}"], flush=True)
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    policy = os.environ["OMP_WAIT_POLICY"]
    print(json.dumps({"threads": args.threads, "clock": args.clock, "isa": args.isa, "load": load,
                      "omp_wait_policy": policy, "cases": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
