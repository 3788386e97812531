"""Decode steps of a device engine replayed from CUDA graphs, at bucketed shapes.

A decode step at a small batch is hundreds of small kernels, each launched from Python: on a GPU
the launches, not the math, set its time. A step is captured once per (batch bucket, block-table
width bucket) into a CUDA graph over static input buffers and replayed thereafter: the step's
inputs are copied into the buffers (padded), the graph replays every kernel at once, and the
logits of the real rows are read back. Buckets are powers of two (batch up to `max_batch`, width
up to the longest context's blocks), so a few dozen graphs cover a serving run; they share one
memory pool. A step that fits no bucket (a batch above `max_batch`) runs eagerly.

Padding rows write their k/v to a scratch block the block manager never hands out (the KV pools
hold one block more: `scratch_block`), attend over one token of it, and their logits are dropped;
padding columns of the block tables point at it too and are masked by the context lengths. A
real row's math is the eager step's over a wider, masked block table: the masked slots weigh
exactly 0, and only the reductions' order over the wider width may round differently.

`capture=False` replays "graphs" eagerly over the same padded buffers: the CPU tests check the
padding and scratch logic through it, which the GPU run then only captures.

Faults: a capture that fails (out of device memory) raises in the step that asked for it, which
fails as any step error does; nothing is cached for that bucket, so a later step tries again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from common.engine.runner import StepInputs
from common.scheduling.batching import Phase

DEFAULT_MAX_BATCH = 256


@dataclass
class _Captured:
    inputs: StepInputs  # the static buffers, at the bucket's shapes
    logits: torch.Tensor | None  # the graph's output buffer (None: eager)
    graph: torch.cuda.CUDAGraph | None


def bucket(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


class DecodeGraphs:
    """Replays a runner's decode forward (`forward`) from graphs keyed by padded shape."""

    def __init__(
        self,
        forward: Callable[..., torch.Tensor],
        device: torch.device,
        scratch_block: int,
        block_size: int,
        max_blocks: int,
        max_batch: int = DEFAULT_MAX_BATCH,
        capture: bool = True,
    ) -> None:
        """`forward(inputs) -> logits [N, vocab]`: the eager decode step. `scratch_block`: a KV
        block no request owns; `max_blocks`: the widest block table a step can have."""
        self.forward = forward
        self.device = device
        self.scratch_block = scratch_block
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.max_batch = max_batch
        self.capture = capture
        self.captured: dict[tuple[int, int], _Captured] = {}
        self.pool: Any = None  # the graphs' shared memory pool (the first graph's)
        self.num_replays = 0

    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        """The logits [N, vocab] of a decode step, replayed; None where it fits no bucket."""
        n, width = len(inputs.req_ids), inputs.block_tables.shape[1]
        if n > self.max_batch or width > self.max_blocks:
            return None
        key = (bucket(n), min(bucket(width), self.max_blocks))
        entry = self.captured.get(key)
        if entry is None:
            entry = self._capture(*key)
            self.captured[key] = entry
        self._fill(entry.inputs, inputs, n, width)
        self.num_replays += 1
        if entry.graph is None:
            return self.forward(entry.inputs)[:n]
        entry.graph.replay()
        assert entry.logits is not None
        return entry.logits[:n].clone()  # the next replay overwrites the buffer

    def _static(self, batch: int, width: int) -> StepInputs:
        """Buffers at the bucket's shapes, every row a padding row."""
        d, scratch_slot = self.device, self.scratch_block * self.block_size
        return StepInputs(
            phase=Phase.DECODE,
            req_ids=[""] * batch,
            input_ids=torch.zeros(batch, dtype=torch.long, device=d),
            positions=torch.zeros(batch, dtype=torch.long, device=d),
            slot_mapping=torch.full((batch,), scratch_slot, dtype=torch.long, device=d),
            seq_lens=[1] * batch,
            block_tables=torch.full(
                (batch, width), self.scratch_block, dtype=torch.int32, device=d
            ),
            context_lens=torch.ones(batch, dtype=torch.int32, device=d),
            last_token_index=torch.arange(batch, device=d),
        )

    def _fill(self, static: StepInputs, inputs: StepInputs, n: int, width: int) -> None:
        """The step's rows into the buffers; the rows and columns past them back to padding."""
        static.input_ids[:n].copy_(inputs.input_ids)
        static.positions[:n].copy_(inputs.positions)
        static.slot_mapping[:n].copy_(inputs.slot_mapping)
        static.context_lens[:n].copy_(inputs.context_lens)
        static.block_tables[:n, :width].copy_(inputs.block_tables)
        static.block_tables[:n, width:].fill_(self.scratch_block)
        static.input_ids[n:].zero_()
        static.positions[n:].zero_()
        static.slot_mapping[n:].fill_(self.scratch_block * self.block_size)
        static.context_lens[n:].fill_(1)
        static.block_tables[n:].fill_(self.scratch_block)

    @torch.inference_mode()
    def _capture(self, batch: int, width: int) -> _Captured:
        static = self._static(batch, width)
        if not self.capture:
            return _Captured(static, None, None)
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):  # warm-up: lazy inits and workspaces, outside the graph
            self.forward(static)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.forward(static)
        if self.pool is None:
            self.pool = graph.pool()
        return _Captured(static, logits, graph)


__all__ = ["DEFAULT_MAX_BATCH", "DecodeGraphs", "bucket"]
