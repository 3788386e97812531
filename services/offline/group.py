"""An offline engine group (Seesaw): one scheduler, k worker processes, one shared KV buffer.

`OfflineGroup.generate(prompts, max_tokens)` runs a whole job to completion, greedy: the pure
policy (`common/scheduling/seesaw.py`) picks each step, prefill in `prefill_sharding` into the
buffer, decode in tensor parallel from the decode slots, and the workers run it
(`services/offline/worker.py`). `Mode` names the configurations the paper compares: `seesaw`
(PP prefill, TP decode, transition-minimizing), `tp` (TP both, prefill first, vLLM's way),
`prefill_first` and `decode_first` (PP prefill, TP decode, other schedules).

Faults: a worker that fails (an exception, a kill) ends the job with `OfflineGroupError` within
`result_timeout_s`, and the group stops every worker; a prompt longer than the group's `max_len`
is refused before anything runs (ValueError).
"""

from __future__ import annotations

import multiprocessing
import queue
import socket
import time
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

from common.config import ModelConfig
from common.scheduling.seesaw import (
    OfflineState,
    Schedule,
    SeesawKnobs,
    Stage,
    Step,
    Waiting,
    apply,
    next_step,
)
from services.offline.worker import KvShape, worker_main

MODES: dict[str, tuple[str, Schedule]] = {
    "seesaw": ("pp", Schedule.TRANSITION_MINIMIZING),
    "tp": ("tp", Schedule.PREFILL_FIRST),
    "prefill_first": ("pp", Schedule.PREFILL_FIRST),
    "decode_first": ("pp", Schedule.DECODE_FIRST),
}


class OfflineGroupError(RuntimeError):
    """A worker failed or stopped answering: the job ends."""


@dataclass
class JobStats:
    num_prefills: int = 0
    num_decode_steps: int = 0
    num_transitions: int = 0  # stage changes (each a re-shard between PP and TP)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    swap_s: float = 0.0  # swap-ins (the KV re-shard)
    wall_s: float = 0.0
    num_tokens: int = 0
    stages: list[str] = field(default_factory=list)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class OfflineGroup:
    def __init__(self, model_path: str | Path, k: int = 2, *, num_buffer_slots: int = 16,
                 num_decode_slots: int = 8, max_len: int = 512, threads_per_worker: int = 1,
                 result_timeout_s: float = 120.0) -> None:  # fmt: skip
        self.config = ModelConfig.from_folder(model_path)
        self.kv = KvShape(num_buffer_slots, num_decode_slots, max_len)
        self.result_timeout_s = result_timeout_s
        self.shm = shared_memory.SharedMemory(create=True, size=self.kv.buffer_bytes(self.config))
        ctx = multiprocessing.get_context("spawn")
        self.results: Any = ctx.Queue()
        self.tasks: list[Any] = [ctx.Queue() for _ in range(k)]
        port = _free_port()
        self.procs = [
            ctx.Process(target=worker_main, daemon=True,
                        args=(r, k, port, str(model_path), self.shm.name, self.kv, self.tasks[r],
                              self.results, threads_per_worker))
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
        self.shm.close()
        self.shm.unlink()

    def __enter__(self) -> OfflineGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, task: tuple[Any, ...]) -> None:
        for t in self.tasks:
            t.put(task)

    def _result(self) -> tuple[list[int], float]:
        deadline = time.monotonic() + self.result_timeout_s
        while True:
            try:
                got = self.results.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline or not all(p.is_alive() for p in self.procs):
                    raise OfflineGroupError("a worker stopped answering") from None
                continue
            if got[0] == "error":
                raise OfflineGroupError(got[1])
            return got  # type: ignore[no-any-return]

    def generate(
        self, prompts: list[list[int]], max_tokens: list[int], mode: str = "seesaw",
        max_prefill_tokens: int = 2048,
    ) -> tuple[list[list[int]], JobStats]:  # fmt: skip
        """Each prompt's greedy output (until EOS or its max_tokens), and the job's figures."""
        for p, m in zip(prompts, max_tokens, strict=True):
            if not p or len(p) + m > self.kv.max_len:
                raise ValueError(f"a request of {len(p)} + {m} tokens does not fit max_len "
                                 f"{self.kv.max_len}")  # fmt: skip
        sharding, schedule = MODES[mode]
        knobs = SeesawKnobs(max_prefill_tokens, schedule)
        kv = self.kv
        state = OfflineState([Waiting(i, len(p)) for i, p in enumerate(prompts)], [], [],
                             kv.num_buffer_slots, kv.num_decode_slots)  # fmt: skip
        free_buffer = list(range(kv.num_buffer_slots))
        free_decode = list(range(kv.num_decode_slots))
        buffer_slot: dict[int, int] = {}
        decode_slot: dict[int, int] = {}
        outputs: list[list[int]] = [[] for _ in prompts]
        eos = set(self.config.eos_token_ids)
        stats = JobStats()
        start = time.perf_counter()

        def done(i: int) -> bool:
            return len(outputs[i]) >= max_tokens[i] or (bool(outputs[i]) and outputs[i][-1] in eos)

        step: Step | None
        while (step := next_step(state, knobs)) is not None:
            stats.num_transitions += step.transition and bool(stats.stages)
            stats.stages.append(step.stage.value)
            finished: list[int] = []
            if step.stage is Stage.PREFILL:
                batch = []
                for i in step.prefill:
                    buffer_slot[i] = free_buffer.pop()
                    batch.append((buffer_slot[i], prompts[i]))
                self._send(("prefill", sharding, batch))
                tokens, seconds = self._result()
                stats.num_prefills += 1
                stats.prefill_s += seconds
                for i, t in zip(step.prefill, tokens, strict=True):
                    outputs[i].append(t)
                    if done(i):
                        finished.append(i)
                        free_buffer.append(buffer_slot.pop(i))
            else:
                if step.swap_in:
                    moves = []
                    for i in step.swap_in:
                        decode_slot[i] = free_decode.pop()
                        moves.append((buffer_slot[i], decode_slot[i], len(prompts[i])))
                        free_buffer.append(buffer_slot.pop(i))
                    self._send(("swap_in", moves))
                    stats.swap_s += self._result()[1]
                rows = [i for i in state.decoding + list(step.swap_in)]
                self._send(("decode", [(decode_slot[i], len(prompts[i]) + len(outputs[i]) - 1,
                                        outputs[i][-1]) for i in rows]))  # fmt: skip
                tokens, seconds = self._result()
                stats.num_decode_steps += 1
                stats.decode_s += seconds
                for i, t in zip(rows, tokens, strict=True):
                    outputs[i].append(t)
                    if done(i):
                        finished.append(i)
                        free_decode.append(decode_slot.pop(i))
            apply(state, step, finished)
        stats.wall_s = time.perf_counter() - start
        stats.num_tokens = sum(len(o) for o in outputs)
        return outputs, stats
