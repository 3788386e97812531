"""`bench/serve.py`'s paths with no server: the in-process engine (`inprocess`, and beside a
synthetic load, `neighbor`), the Router's engine client alone (`client`) and the mesh's own
processes without Ray (`mesh_processes`); `in_fresh_process` runs one in a process of its own."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from bench.cpu_load import BurstLoad
from bench.serve_clients import prompts_for, threads_cpu_and_preemptions
from bench.serve_report import BESIDE
from common.engine.core import LLMEngine
from common.model.default import default_model_path
from common.sampling import SamplingParams

T = TypeVar("T")
REPEATS = 3
ENGINE_ARGS = {"num_blocks": 2048, "block_size": 16, "max_num_batched_tokens": 2048,
               "max_num_seqs": 64}  # fmt: skip


def in_process(
    preset: str, batches: list[int], tokens: int, load_cores: float | None = None
) -> dict[int, dict[str, float]]:
    """One `LLMEngine` generating each batch (token ids only: no front end), the best of
    `REPEATS` runs: its tok/s, the CPU its threads took per token, and how often they were
    preempted per second (what `local` reports for its engine threads, to compare). With
    `load_cores`, beside a `BurstLoad` of that many cores (the `neighbor` path)."""
    engine = LLMEngine.from_path(default_model_path(preset), **ENGINE_ARGS)  # type: ignore[arg-type]
    vocab = model_vocab(preset)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    engine.generate(prompts_for(2, vocab, seed=99), params)  # warm-up
    with BurstLoad(load_cores) if load_cores else contextlib.nullcontext():
        return _batches(engine, vocab, params, batches, tokens)


def neighbor(
    preset: str,
    batches: list[int],
    tokens: int,
    engine_tok_s: dict[int, float],
    neighbor_cores: list[float],
) -> dict[str, Any]:
    """The `neighbor` path: the in-process engine beside each of `neighbor_cores` cores of
    synthetic load, with its ratio to `engine_tok_s`, as `inprocess_beside_<cores>`."""
    results: dict[str, Any] = {}
    for cores in neighbor_cores:
        beside = in_process(preset, batches, tokens, load_cores=cores)
        for batch, figures in beside.items():
            figures["ratio"] = figures["tok_s"] / engine_tok_s[batch]
        results[f"{BESIDE}{cores:g}"] = beside
        print(
            f"  in-process beside {cores:g} cores of load: "
            + ", ".join(f"batch {b} ratio {f['ratio']:.3g}" for b, f in beside.items())
        )
    return results


def _batches(
    engine: LLMEngine, vocab: int, params: SamplingParams, batches: list[int], tokens: int
) -> dict[int, dict[str, float]]:
    result = {}
    for batch in batches:
        runs = []
        for _ in range(REPEATS):  # the best of a few: a shared machine's noise only slows runs
            cpu_before, preempted_before = threads_cpu_and_preemptions(os.getpid())
            start = time.perf_counter()
            engine.generate(prompts_for(batch, vocab), params)
            seconds = time.perf_counter() - start
            cpu, preempted = threads_cpu_and_preemptions(os.getpid())
            runs.append((seconds, cpu - cpu_before, preempted - preempted_before))
        seconds, cpu, preempted = min(runs)
        result[batch] = {"tok_s": batch * tokens / seconds,
                         "cpu_ms_per_token": 1e3 * cpu / (batch * tokens),
                         "preemptions_per_s": preempted / seconds}  # fmt: skip
    return result


def engine_client(
    preset: str, batches: list[int], tokens: int, modes: list[str], threads: int
) -> dict[str, dict[int, dict[str, float]]]:
    """The `client` path: the Router's `InProcessEngineClient` in this process (the engine built
    and stepped on its own thread, outputs through the `StreamTable` to this event loop; no
    HTTP, no Ray): what the served engine would do with the front end's threads alone. `plain`
    requests hold their tokens to the end, as the Router does for them, and get their text as
    the Router's do (made on this loop: `token_text.TokenText`)."""
    from services.router.engine_client import InProcessEngineClient

    vocab = model_vocab(preset)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    client = InProcessEngineClient(
        build=lambda: LLMEngine.from_path(default_model_path(preset), **ENGINE_ARGS),  # type: ignore[arg-type]
        num_threads=threads,
    )

    async def one_batch(batch: int, hold: bool, tag: str) -> float:
        async def one(i: int, prompt: list[int]) -> None:
            async for _ in client.generate(f"{tag}-{i}", prompt, params, hold_to_end=hold):
                pass

        start = time.perf_counter()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts_for(batch, vocab))))
        return batch * tokens / (time.perf_counter() - start)

    result: dict[str, dict[int, dict[str, float]]] = {}
    try:
        asyncio.run(one_batch(2, False, "warm"))
        for mode, batch in ((m, b) for m in modes for b in batches):
            runs = [asyncio.run(one_batch(batch, mode == "plain", f"{mode}{batch}-{r}"))
                    for r in range(REPEATS)]  # fmt: skip
            result.setdefault(mode, {})[batch] = {"tok_s": max(runs)}
    finally:
        client.shutdown()
    return result


def mesh_processes_apart(
    preset: str, batches: list[int], tokens: int, mesh: dict[str, Any]
) -> dict[str, dict[int, dict[str, float]]]:
    """`mesh_processes` in a fresh process whose environment has `OMP_WAIT_POLICY=passive`, as
    its docstring asks."""
    return in_fresh_process(mesh_processes, preset, batches, tokens, mesh,
                            env={"OMP_WAIT_POLICY": "passive"})  # fmt: skip


def mesh_processes(
    preset: str, batches: list[int], tokens: int, mesh: dict[str, Any]
) -> dict[str, dict[int, dict[str, float]]]:
    """The `mesh_processes` path: the mesh `serve run deploy/local.yaml` starts, as the same OS
    processes without Ray (`services.launch.LocalMesh`: a prompt engine, a token engine of
    `token_engine_threads` and its `shards_per_group` shards, unpinned as Ray leaves replicas;
    the served mesh's options as they are, but no model peers), driven by the Router's own
    `MeshEngineClient` in this process with plain requests (tokens held to the end, as the
    Router holds a plain request's). Against the served `mesh`
    path it says what Ray's runtime, Serve and HTTP on the same cores cost the mesh. Run it in a
    process whose environment has `OMP_WAIT_POLICY=passive`, as the token engine's replica gets it
    (deploy/local.yaml's runtime_env; libgomp reads it once, in the fork server that every
    worker comes from)."""
    from common.mesh_options import mesh_options
    from services.launch.local_mesh import LocalMesh, Topology
    from services.router.mesh_client import MeshEngineClient

    vocab = model_vocab(preset)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    options = mesh_options(mesh | {"model_peers": 0})  # the served mesh's options, as they are
    topology = Topology(
        str(default_model_path(preset)), num_shards=options.shards_per_group,
        pin_decode_groups=False, options=options,
    )  # fmt: skip
    launched = LocalMesh.start(topology)
    client = MeshEngineClient(str(topology.model_path), launched.registry.live, auth=launched.auth)

    async def one_batch(prompts: list[list[int]], tag: str) -> float:
        async def one(i: int, prompt: list[int]) -> None:
            async for _ in client.generate(f"{tag}-{i}", prompt, params, hold_to_end=True):
                pass

        start = time.perf_counter()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return len(prompts) * tokens / (time.perf_counter() - start)

    async def run_all() -> dict[int, dict[str, float]]:
        await one_batch(prompts_for(2, vocab, seed=99), "warm")
        result = {}
        for batch in batches:
            runs = [await one_batch(prompts_for(batch, vocab), f"b{batch}-{r}")
                    for r in range(REPEATS)]  # fmt: skip
            result[batch] = {"tok_s": max(runs)}
        return result

    try:
        return {"plain": asyncio.run(run_all())}
    finally:
        client.shutdown()
        launched.close()


def model_vocab(preset: str) -> int:
    config = json.loads((default_model_path(preset) / "config.json").read_text())
    return int(config["vocab_size"])


def in_fresh_process(fn: Callable[..., T], *args: Any, env: dict[str, str] | None = None) -> T:
    """`fn(*args)` in a process spawned for it, with `env` over this process's environment
    (what the processes it starts inherit too); this process's environment is left as it was."""
    with environ(**(env or {})):
        spawn = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
            return pool.submit(fn, *args).result()


@contextlib.contextmanager
def environ(**values: str) -> Iterator[None]:
    """`values` in this process's environment (for the processes it starts meanwhile), then as
    they were."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
