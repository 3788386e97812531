"""An offline engine group (Seesaw): one scheduler, k worker processes, one shared KV buffer.

`OfflineGroup.generate(prompts, max_tokens)` runs a whole job to completion, greedy: the pure
policy (`common/scheduling/seesaw.py`) picks each step, prefill in the mode's prefill sharding
into the buffer, decode in its decode sharding from the decode slots, and the workers run it
(`services/offline/worker.py`). `MODES` names the configurations the paper compares: `seesaw`
(PP prefill, TP decode, transition-minimizing), `tp` and `pp` (one sharding for both stages,
prefill first: vLLM's way), `prefill_first` and `decode_first` (PP prefill, TP decode, the other
schedules).

Faults: a worker that fails (an exception, a kill) ends the job with `OfflineGroupError` within
`result_timeout_s`, and the group stops every worker; a prompt longer than the group's `max_len`
is refused before anything runs (ValueError). Until every worker has loaded the model (a group
starts with its first job), a result may take up to `start_timeout_s` instead: a slow load (a
large model, a busy node) is start-up, not a worker that stopped answering.
"""

from __future__ import annotations

import multiprocessing
import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

from common.config import ModelConfig
from common.scheduling.seesaw import (
    OfflineState,
    SeesawKnobs,
    Stage,
    Step,
    Waiting,
    apply,
    next_step,
)
from services.offline.options import MODES, KvShape


class OfflineGroupError(RuntimeError):
    """A worker failed or stopped answering: the job ends."""


@dataclass
class JobStats:
    num_prefills: int = 0
    num_decode_steps: int = 0
    num_transitions: int = 0  # stage changes (a re-shard where the two shardings differ)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    swap_s: float = 0.0  # decode steps' waits for the KV re-shard (swap-outs landed, swap-ins)
    wall_s: float = 0.0
    num_tokens: int = 0
    stages: list[str] = field(default_factory=list)
    # Each request's (step it was prefilled in, step it ended in): indexes into `stages`.
    lifetimes: dict[int, tuple[int, int]] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)  # requests that ended (EOS or max_tokens)

    def transitions_crossed(self, req_id: int) -> int:
        """Stage changes between a request's prefill and its last token."""
        first, last = self.lifetimes[req_id]
        seen = self.stages[first : last + 1]
        return sum(a != b for a, b in zip(seen, seen[1:], strict=False))


def run_worker(*args: Any) -> None:
    """A worker process's entry: `services.offline.worker.worker_main`, imported in the worker."""
    from services.offline.worker import worker_main

    worker_main(*args)


class OfflineGroup:
    def __init__(self, model_path: str | Path, k: int = 2, *, num_buffer_slots: int = 16,
                 num_decode_slots: int = 8, max_len: int = 512, threads_per_worker: int = 1,
                 result_timeout_s: float = 120.0, start_timeout_s: float = 600.0,
                 weight_cache: Path | None = None) -> None:  # fmt: skip
        self.config = ModelConfig.from_folder(model_path)
        self.kv = KvShape(num_buffer_slots, num_decode_slots, max_len)
        self.result_timeout_s = result_timeout_s
        self.start_timeout_s = start_timeout_s
        self.loading = set(range(k))  # the ranks that have not said ("loaded", rank) yet
        self.started_at = time.monotonic()
        self.shm = shared_memory.SharedMemory(create=True, size=self.kv.buffer_bytes(self.config))
        self.procs: list[Any] = []
        try:
            self._start_workers(model_path, k, threads_per_worker, weight_cache)
        except BaseException:  # no worker, no segment left behind by a start that failed
            for p in self.procs:
                if p.pid is not None:  # started: killed (its peers will never join it)
                    p.kill()
                    p.join()
            self._free_buffer()
            raise

    def _start_workers(
        self, model_path: str | Path, k: int, threads_per_worker: int, weight_cache: Path | None
    ) -> None:
        # Forked by multiprocessing's fork server, as `LocalMesh` workers are: where the server
        # imported torch already (a launcher that runs a LocalMesh, or whose main module imports
        # torch), a worker does not spend seconds importing it again before its first step.
        # The workers import the model's code (`run_worker`); this process, the Batch API's
        # replica under Serve, never does.
        ctx = multiprocessing.get_context("forkserver")
        self.results: Any = ctx.Queue()
        self.tasks: list[Any] = [ctx.Queue() for _ in range(k)]
        # Rank 0's store port, to its peers (`join_group`); kept: a worker unpickles it after its
        # start, and the queue's semaphores go with the last reference here.
        self.rendezvous: Any = ctx.Queue()
        self.procs = [
            ctx.Process(target=run_worker, daemon=True,
                        args=(r, k, self.rendezvous, str(model_path), self.shm.name, self.kv,
                              self.tasks[r], self.results, threads_per_worker, weight_cache))
            for r in range(k)
        ]  # fmt: skip
        for p in self.procs:
            p.start()

    def close(self) -> None:
        for t in self.tasks:
            t.put(("stop",))
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        self._free_buffer()

    def _free_buffer(self) -> None:
        self.shm.close()
        self.shm.unlink()

    def __enter__(self) -> OfflineGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, task: tuple[Any, ...]) -> None:
        for t in self.tasks:
            t.put(task)

    def _deadline(self) -> float:
        """When the result awaited from now counts as lost: `start_timeout_s` from the group's
        start while a worker is still loading the model, else `result_timeout_s` from now."""
        if self.loading:
            return self.started_at + self.start_timeout_s
        return time.monotonic() + self.result_timeout_s

    def _result(self) -> tuple[list[int], float, float]:
        deadline = self._deadline()
        while True:
            try:
                got = self.results.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline or not all(p.is_alive() for p in self.procs):
                    raise OfflineGroupError("a worker stopped answering") from None
                continue
            if got[0] == "error":
                raise OfflineGroupError(got[1])
            if got[0] == "loaded":
                self.loading.discard(got[1])
                deadline = self._deadline()
                continue
            return got  # type: ignore[no-any-return]

    def generate(
        self, prompts: list[list[int]], max_tokens: list[int], mode: str = "seesaw",
        max_prefill_tokens: int = 2048, stop: Callable[[], bool] | None = None,
    ) -> tuple[list[list[int]], JobStats]:  # fmt: skip
        """Each prompt's greedy output (until EOS or its max_tokens), and the job's figures.
        `stop`, asked between steps: True ends the job there (a cancel); the requests that
        ended by then are `stats.finished`, the others' outputs are cut short."""
        for p, m in zip(prompts, max_tokens, strict=True):
            if not p or len(p) + m > self.kv.max_len:
                raise ValueError(f"a request of {len(p)} + {m} tokens does not fit max_len "
                                 f"{self.kv.max_len}")  # fmt: skip
        prefill_sharding, decode_sharding, schedule = MODES[mode]
        knobs = SeesawKnobs(max_prefill_tokens, schedule)
        kv = self.kv
        state = OfflineState([Waiting(i, len(p)) for i, p in enumerate(prompts)], [], [],
                             kv.num_buffer_slots, kv.num_decode_slots)  # fmt: skip
        job = _Job(prompts, max_tokens, kv, set(self.config.eos_token_ids))
        start = time.perf_counter()
        step: Step | None
        while (step := next_step(state, knobs)) is not None and not (stop and stop()):
            job.stats.num_transitions += step.transition and bool(job.stats.stages)
            job.stats.stages.append(step.stage.value)
            if step.stage is Stage.PREFILL:
                finished = self._prefill(job, step, prefill_sharding)
            else:
                finished = self._decode(job, step, state.decoding, decode_sharding)
            apply(state, step, finished)
        job.stats.wall_s = time.perf_counter() - start
        job.stats.num_tokens = sum(len(o) for o in job.outputs)
        return job.outputs, job.stats

    def _prefill(self, job: _Job, step: Step, sharding: str) -> list[int]:
        """Prefill `step.prefill` into buffer slots; those that ended at their first token."""
        batch = []
        for i in step.prefill:
            job.buffer_slot[i] = job.free_buffer.pop()
            batch.append((job.buffer_slot[i], job.prompts[i]))
        self._send(("prefill", sharding, batch))
        tokens, seconds, _ = self._result()
        job.stats.num_prefills += 1
        job.stats.prefill_s += seconds
        return job.take(step.prefill, tokens, job.buffer_slot, job.free_buffer)

    def _decode(self, job: _Job, step: Step, decoding: list[int], sharding: str) -> list[int]:
        """One decode step of every decoding request and of `step.swap_in`, swapped into decode
        slots as the step runs; those that ended."""
        moves = []
        for i in step.swap_in:
            job.decode_slot[i] = job.free_decode.pop()
            moves.append((job.buffer_slot[i], job.decode_slot[i], len(job.prompts[i])))
            job.free_buffer.append(job.buffer_slot.pop(i))
        rows = [*decoding, *step.swap_in]
        self._send(("decode", sharding, moves, [job.decode_row(i) for i in rows]))
        tokens, seconds, waited = self._result()
        job.stats.num_decode_steps += 1
        job.stats.decode_s += seconds
        job.stats.swap_s += waited
        return job.take(rows, tokens, job.decode_slot, job.free_decode)


class _Job:
    """One job's requests as the group runs them: outputs so far and the slots they hold."""

    def __init__(self, prompts: list[list[int]], max_tokens: list[int], kv: KvShape,
                 eos: set[int]) -> None:  # fmt: skip
        self.prompts, self.max_tokens, self.eos = prompts, max_tokens, eos
        self.outputs: list[list[int]] = [[] for _ in prompts]
        self.free_buffer = list(range(kv.num_buffer_slots))
        self.free_decode = list(range(kv.num_decode_slots))
        self.buffer_slot: dict[int, int] = {}
        self.decode_slot: dict[int, int] = {}
        self.stats = JobStats()

    def decode_row(self, i: int) -> tuple[int, int, int]:
        """(decode slot, position of its last token, that token)."""
        out = self.outputs[i]
        return self.decode_slot[i], len(self.prompts[i]) + len(out) - 1, out[-1]

    def take(self, rows: Sequence[int], tokens: list[int], slots: dict[int, int],
             free: list[int]) -> list[int]:  # fmt: skip
        """Each row's new token; the rows that ended (EOS or max_tokens), their slot freed."""
        finished = []
        step = len(self.stats.stages) - 1
        for i, token in zip(rows, tokens, strict=True):
            self.outputs[i].append(token)
            if len(self.outputs[i]) == 1:
                self.stats.lifetimes[i] = (step, step)
            if token in self.eos or len(self.outputs[i]) >= self.max_tokens[i]:
                finished.append(i)
                self.stats.finished.add(i)
                free.append(slots.pop(i))
                self.stats.lifetimes[i] = (self.stats.lifetimes[i][0], step)
        return finished
