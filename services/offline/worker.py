"""One worker of an offline group (Seesaw §5.1): a process with its task queue, running the
scheduler's instructions in order on its shard of the model, over `torch.distributed` (gloo on
CPU) with the group's other workers.

KV lives in two places, both in HND layout ([layers, 2, kv heads, tokens, head_dim] per request):
- the **buffer**, shared memory every worker maps: prefill writes each request's KV there (a PP
  worker its layers, all heads; a TP worker its heads, all layers), so the complete KV forms there
  whatever the prefill's sharding (Fig. 7), copied on a swap-out thread while the next layer
  computes (§5.2);
- each worker's **decode slots**: for tensor-parallel decode its KV heads of every layer, for
  pipeline-parallel decode every head of its layers (the same bytes, viewed two ways), swapped in
  from the buffer (the re-shard) and grown by each decode step. Swap-in runs on its own thread,
  one layer at a time, overlapping the decode step that needs it (§5.2).

Instructions (tuples on the task queue): `("prefill", sharding, [(buffer_slot, token_ids)])`,
`("decode", sharding, [(buffer_slot, decode_slot, num_tokens)] to swap in first,
[(decode_slot, position, token)])`, `("stop",)`. The worker that ends an instruction with the
logits (the last PP stage, or TP rank 0) puts `(greedy tokens, seconds, seconds waited for
swap-ins)` on the result queue.

Faults: a worker that raises puts `("error", repr)` on the result queue and exits; the group then
stops every worker and fails the job (`OfflineGroup` raises), never hangs: its waits on results
have a deadline.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from multiprocessing import shared_memory
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.model.llama import causal_attention
from common.model.loader import load_model
from services.offline.options import KvShape
from services.offline.sharding import TpShard, pp_layers

# How long a worker waits for its peers to join the group (rank 0's store, then each other's).
JOIN_TIMEOUT_S = 300.0


def join_group(rank: int, k: int, rendezvous: Queue, timeout_s: float) -> None:
    """Joins the group's gloo process group. Rank 0 serves its store on a port the kernel picks
    while binding it and hands that port to its peers through `rendezvous`: a port chosen free
    beforehand and bound later could be taken by another process in between.

    A rank 0 that dies before handing it over leaves its peers waiting: they give up after
    `timeout_s` (queue.Empty), as the group gives up on a worker that stopped answering."""
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        # Not waiting here for the peers, which learn the port only below.
        store = dist.TCPStore("127.0.0.1", 0, k, is_master=True, timeout=timeout,
                              wait_for_workers=False)  # fmt: skip
        for _ in range(k - 1):
            rendezvous.put(store.port)
    else:
        port = rendezvous.get(timeout=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, k, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=k)


def worker_main(rank: int, k: int, rendezvous: Queue, model_path: str, shm_name: str,
                kv: KvShape, tasks: Queue, results: Queue, num_threads: int,
                weight_cache: Path | None = None,
                join_timeout_s: float = JOIN_TIMEOUT_S) -> None:  # fmt: skip
    """A worker's life: join the group, load the model (from the node's weight cache where
    given), say so (`("loaded", rank)`: the group's start-up wait ends), then serve tasks."""
    torch.set_num_threads(num_threads)
    shm = None
    try:
        join_group(rank, k, rendezvous, join_timeout_s)
        model = load_model(model_path, weight_cache=weight_cache)
        shm = shared_memory.SharedMemory(name=shm_name)
        results.put(("loaded", rank))
        OfflineWorker(rank, k, model, shm, kv, results).serve(tasks)
    except Exception:  # noqa: BLE001 - reported to the group, which stops the job
        results.put(("error", f"worker {rank}: {traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if shm is not None:
            shm.close()


class OfflineWorker:
    def __init__(self, rank: int, k: int, model: Any, shm: shared_memory.SharedMemory,
                 kv: KvShape, results: Queue) -> None:  # fmt: skip
        c = model.config
        self.rank, self.k, self.model, self.config, self.results = rank, k, model, c, results
        self.buffer = torch.frombuffer(shm.buf, dtype=torch.float32).view(kv.buffer_shape(c))
        self.tp = TpShard(model, k, rank)
        self.layers = pp_layers(c.num_hidden_layers, k, rank)
        heads = self.tp.kv_heads
        self.heads = slice(heads.start, heads.stop)
        slots = torch.zeros(kv.num_decode_slots * c.num_hidden_layers * 2 * self.tp.hk
                            * kv.max_len * c.head_dim)  # fmt: skip
        self.slots_tp = slots.view(kv.num_decode_slots, c.num_hidden_layers, 2, self.tp.hk,
                                   kv.max_len, c.head_dim)  # fmt: skip
        self.slots_pp = slots.view(kv.num_decode_slots, len(self.layers), 2,
                                   c.num_key_value_heads, kv.max_len, c.head_dim)  # fmt: skip
        # Swap-out on its own thread (§5.2): a layer's KV is copied into the shared buffer while
        # the next layer computes; `_flush` waits for the copies before anyone reads them.
        self.swapper = ThreadPoolExecutor(1, thread_name_prefix="swap-out")
        self.pending: list[Future[None]] = []
        self.swap_in_thread = ThreadPoolExecutor(1, thread_name_prefix="swap-in")

    def serve(self, tasks: Queue) -> None:
        while True:
            task = tasks.get()
            kind = task[0]
            start = time.perf_counter()
            if kind == "stop":
                self._flush()
                self.swapper.shutdown()
                self.swap_in_thread.shutdown()
                del self.buffer  # the shared memory's views end before it closes
                return
            waited = 0.0
            if kind == "prefill":
                out = self.prefill_pp(task[2]) if task[1] == "pp" else self.prefill_tp(task[2])
            elif kind == "decode":
                out, waited = self.decode(task[1], task[2], task[3])
            else:
                raise ValueError(f"unknown instruction {kind!r}")
            if out is not None:
                self.results.put((out, time.perf_counter() - start, waited))

    def all_reduce(self, t: torch.Tensor) -> None:
        dist.all_reduce(t)

    # ---- prefill ----

    def _packed(self, batch: list[tuple[int, list[int]]]) -> tuple[torch.Tensor, list[int], Any]:
        seq_lens = [len(ids) for _, ids in batch]
        ids = torch.tensor([t for _, toks in batch for t in toks], dtype=torch.long)
        positions = torch.cat([torch.arange(n) for n in seq_lens])
        return ids, seq_lens, self.model.rotary_at(positions)

    def _store(self, batch: list[tuple[int, list[int]]], seq_lens: list[int], n: int,
               k: torch.Tensor, v: torch.Tensor, heads: slice) -> None:  # fmt: skip
        """Layer n's K/V of each request into the buffer, on the swap-out thread."""

        def copy() -> None:
            start = 0
            for (slot, _), length in zip(batch, seq_lens, strict=True):
                end = start + length
                self.buffer[slot, n, 0, heads, :length] = k[start:end].transpose(0, 1)
                self.buffer[slot, n, 1, heads, :length] = v[start:end].transpose(0, 1)
                start = end

        self.pending.append(self.swapper.submit(copy))

    def _flush(self) -> None:
        for done in self.pending:
            done.result()  # re-raises a failed copy here, on the worker's loop
        self.pending.clear()

    def _first_tokens(self, x: torch.Tensor, seq_lens: list[int]) -> list[int]:
        last = torch.tensor(seq_lens).cumsum(0) - 1
        return self.model.compute_logits(x[last]).argmax(-1).tolist()

    def prefill_pp(self, batch: list[tuple[int, list[int]]]) -> list[int] | None:
        ids, seq_lens, rope = self._packed(batch)
        hidden = self.config.hidden_size
        if self.rank == 0:
            x = self.model.embed(ids)
        else:
            x = torch.empty(ids.shape[0], hidden)
            dist.recv(x, self.rank - 1)
        every = slice(0, self.config.num_key_value_heads)
        for n in self.layers:
            layer = self.model.layers[n]
            q, k, v = layer.pre_attention(x, rope)
            self._store(batch, seq_lens, n, k, v, every)
            x = layer.post_attention(x, causal_attention(q, k, v, seq_lens, self.model.scale))
        if self.rank < self.k - 1:
            dist.send(x.contiguous(), self.rank + 1)
            return None
        return self._first_tokens(x, seq_lens)

    def prefill_tp(self, batch: list[tuple[int, list[int]]]) -> list[int] | None:
        ids, seq_lens, rope = self._packed(batch)
        x = self.model.embed(ids)
        for n in range(self.config.num_hidden_layers):
            x, k, v = self.tp.prefill_layer(n, x, rope, seq_lens, self.all_reduce)
            self._store(batch, seq_lens, n, k, v, self.heads)
        return self._first_tokens(x, seq_lens) if self.rank == 0 else None

    # ---- decode ----

    def _start_swap_in(
        self, moves: list[tuple[int, int, int]], sharding: str
    ) -> list[Future[None]]:
        """Re-shard the moved requests' KV, buffer -> this worker's decode slots, one layer at a
        time on the swap-in thread (§5.2): the decode step waits for layer n's copy only when it
        reaches layer n. Every worker's swap-outs land first (a TP worker reads layers another
        one wrote)."""
        self._flush()
        dist.barrier()
        slots = self.slots_tp if sharding == "tp" else self.slots_pp
        heads = self.heads if sharding == "tp" else slice(0, self.config.num_key_value_heads)
        layers = range(self.config.num_hidden_layers) if sharding == "tp" else self.layers

        def copy(local: int, n: int) -> None:
            for buffer_slot, decode_slot, length in moves:
                slots[decode_slot, local, :, :, :length] = self.buffer[buffer_slot, n, :, heads,
                                                                       :length]  # fmt: skip

        return [self.swap_in_thread.submit(copy, j, n) for j, n in enumerate(layers)]

    def decode(self, sharding: str, moves: list[tuple[int, int, int]],
               rows: list[tuple[int, int, int]]) -> tuple[list[int] | None, float]:  # fmt: skip
        """Swap `moves` in (overlapping the step), then one greedy decode step of `rows`, each
        (decode slot, position, last token): the tokens (None on a worker that does not end it)
        and the seconds this worker waited for the re-shard (swap-outs landing, swap-ins)."""
        start = time.perf_counter()
        copies = self._start_swap_in(moves, sharding) if moves else []
        waited = time.perf_counter() - start  # every worker's swap-outs landed (flush, barrier)

        def layer_kv(local: int) -> None:
            nonlocal waited
            if copies:
                start = time.perf_counter()
                copies[local].result()
                waited += time.perf_counter() - start

        slots = [s for s, _, _ in rows]
        positions = torch.tensor([p for _, p, _ in rows])
        rope = self.model.rotary_at(positions)
        if sharding == "tp":
            return self._decode_tp(rows, slots, positions, rope, layer_kv), waited
        return self._decode_pp(rows, slots, positions, rope, layer_kv), waited

    def _decode_tp(self, rows: list[tuple[int, int, int]], slots: list[int],
                   positions: torch.Tensor, rope: Any, layer_kv: Callable[[int], None]
                   ) -> list[int] | None:  # fmt: skip
        x = self.model.embed(torch.tensor([t for _, _, t in rows], dtype=torch.long))
        tp = self.tp
        for n in range(self.config.num_hidden_layers):
            q, k, v = tp.qkv(n, x, rope)
            layer_kv(n)
            out = self._attend(self.slots_tp, n, slots, positions, q, k, v)
            x = tp.post_attention(n, x, out, self.all_reduce)
        return self.model.compute_logits(x).argmax(-1).tolist() if self.rank == 0 else None

    def _decode_pp(self, rows: list[tuple[int, int, int]], slots: list[int],
                   positions: torch.Tensor, rope: Any, layer_kv: Callable[[int], None]
                   ) -> list[int] | None:  # fmt: skip
        """Pure pipeline-parallel decode: this worker's layers, all heads, hidden states passed
        on (one micro-batch: the stages take turns)."""
        if self.rank == 0:
            x = self.model.embed(torch.tensor([t for _, _, t in rows], dtype=torch.long))
        else:
            x = torch.empty(len(rows), self.config.hidden_size)
            dist.recv(x, self.rank - 1)
        for local, n in enumerate(self.layers):
            layer = self.model.layers[n]
            q, k, v = layer.pre_attention(x, rope)
            layer_kv(local)
            x = layer.post_attention(x, self._attend(self.slots_pp, local, slots, positions,
                                                     q, k, v))  # fmt: skip
        if self.rank < self.k - 1:
            dist.send(x.contiguous(), self.rank + 1)
            return None
        return self.model.compute_logits(x).argmax(-1).tolist()

    def _attend(self, cache: torch.Tensor, local: int, slots: list[int], positions: torch.Tensor,
                q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """Append each row's k/v at its position in its slot (layer `local` of `cache`) and
        attend over the slot's tokens so far: out [rows, q heads, D]."""
        out = torch.empty_like(q)
        for row, (slot, pos) in enumerate(zip(slots, positions.tolist(), strict=True)):
            cache[slot, local, 0, :, pos] = k[row]
            cache[slot, local, 1, :, pos] = v[row]
            keys = cache[slot, local, 0, :, : pos + 1]  # [kv heads, L, D]
            values = cache[slot, local, 1, :, : pos + 1]
            out[row] = F.scaled_dot_product_attention(
                q[row].unsqueeze(1), keys, values, scale=self.model.scale, enable_gqa=True
            ).squeeze(1)
        return out
