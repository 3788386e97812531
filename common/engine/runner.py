"""The model runner: turns a scheduled batch into logits, one layer's three stages at a time.

Attention is the one pluggable stage (`attend`): local paged attention here; the token engine
swaps in a shard round trip (services/engine/engine.py) without touching the rest of the loop.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

from common.attention import AttentionBackend
from common.attention.prefix_prefill import prefix_prefill_attention
from common.block_manager import BlockManager
from common.kv_cache import KVCache
from common.logprobs import token_logprobs
from common.model.fused_decode import FusedDecode
from common.model.linear import POST_ATTENTION_MAX_ROWS, pack_generation
from common.model.llama import LlamaForCausalLM
from common.protocol import TokenLogprobs
from common.scheduling.batching import Batch, Phase

if TYPE_CHECKING:
    from common.engine.decode_graphs import DecodeGraphs

# Prompt positions whose logits (and log-softmax) are held at once for prompt logprobs: two
# [chunk, vocab] float32 tensors, a few tens of MiB at a large vocabulary.
PROMPT_LOGPROBS_CHUNK = 64
# A step's tensors, moved to a device runner's device once each (`ModelRunner.place`).
STEP_TENSORS = (
    "input_ids", "positions", "slot_mapping", "block_tables", "context_lens", "last_token_index",
)  # fmt: skip


@dataclass
class StepInputs:
    """Tensors for one forward step, built once and read by every layer."""

    phase: Phase
    req_ids: list[str]
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] flat KV slots the new k/v go to
    seq_lens: list[int]  # prefill: tokens per sequence
    block_tables: torch.Tensor  # decode: [N, max_blocks] int32
    context_lens: torch.Tensor  # decode: [N] int32, including the input token
    last_token_index: torch.Tensor  # [N] row of each sequence's last token in [T]
    # Prefill: tokens already cached before each sequence's new ones (empty: none anywhere).
    prefix_lens: list[int] = field(default_factory=list)

    def fields(self) -> dict[str, Any]:
        """This step's fields by name, to build a richer plan from them (`StepPlan`)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


Inputs = TypeVar("Inputs", bound=StepInputs)
Placed = TypeVar("Placed", bound=StepInputs)


class ModelRunner(Generic[Inputs]):
    """Owns the model, the local KV cache and the attention backend of one engine.

    `Inputs` is what one step carries: `StepInputs` here; a runner whose attention goes elsewhere
    (services/engine/runner.py) passes a plan that also says where."""

    # Whether this runner's `attend` of a decode step is the local cache write and decode below,
    # which the fused layers run themselves: a subclass whose decode steps attend otherwise
    # through `forward` sets it False.
    LOCAL_ATTEND = True

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        blocks: BlockManager,
        backend: AttentionBackend,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.blocks = blocks
        self.backend = backend
        self.hidden: torch.Tensor | None = None  # the last step's, when it was asked to keep it
        # The KV's device is the runner's: a step's inputs are built on the host, then moved.
        # (A runner without a cache, as some tests build one, is on the CPU.)
        self.device: torch.device = getattr(kv_cache, "device", torch.device("cpu"))
        self.on_device = self.device.type != "cpu"
        self.graphs: DecodeGraphs | None = None  # `use_graphs`
        # Decode steps through the fused layers (`fused_decode`) where they apply (False: the
        # stages one by one, to compare); the pack generation a build last refused at.
        self.fuse_decode = True
        self._fused: FusedDecode | None = None
        self._fused_refused_at: int | None = None

    def place(self, inputs: Placed) -> Placed:
        """`inputs` with its tensors on this runner's device (the same object, untouched, on the
        CPU); the copies are queued without waiting."""
        if self.on_device:
            for name in STEP_TENSORS:
                setattr(inputs, name, getattr(inputs, name).to(self.device, non_blocking=True))
        return inputs

    def prepare(self, batch: Batch, token_ids: Mapping[str, Sequence[int]]) -> StepInputs:
        """Gather the inputs of every scheduled sequence (token_ids: all tokens so far)."""
        if batch.phase is Phase.DECODE:
            return self._prepare_decode(batch, token_ids)
        req_ids = [s.req_id for s in batch.seqs]
        spans = [(s.num_computed, s.num_tokens) for s in batch.seqs]
        # NOTE: built as Python lists and turned into tensors once each (`int_tensor`): a decode
        # step's inputs are a few dozen numbers, and every small torch op costs microseconds.
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for r, (a, b) in zip(req_ids, spans, strict=True):
            ids += token_ids[r][a:b]
            positions += range(a, b)
            slots += self.blocks.slots(r, a, b)
        seq_lens = [b - a for a, b in spans]
        inputs = StepInputs(
            phase=batch.phase,
            req_ids=req_ids,
            input_ids=int_tensor(ids),
            positions=int_tensor(positions),
            slot_mapping=int_tensor(slots),
            seq_lens=seq_lens,
            block_tables=pad_block_tables([self.blocks.block_table(r) for r in req_ids]),
            context_lens=int_tensor([b for _, b in spans], torch.int32),
            last_token_index=torch.tensor(seq_lens).cumsum(0) - 1,
            prefix_lens=[a for a, _ in spans],
        )
        return self.place(inputs)

    def _prepare_decode(self, batch: Batch, token_ids: Mapping[str, Sequence[int]]) -> StepInputs:
        """A decode step's inputs: each sequence's last token, in one pass over the batch (this
        runs every step for every sequence: it is written for the interpreter's sake)."""
        req_ids = [s.req_id for s in batch.seqs]
        positions = [s.num_tokens - 1 for s in batch.seqs]
        tables = [self.blocks.block_table(r) for r in req_ids]
        slots = token_slots(tables, positions, self.blocks.block_size)
        n = len(req_ids)
        ids = [token_ids[r][p] for r, p in zip(req_ids, positions, strict=True)]
        inputs = StepInputs(
            phase=batch.phase,
            req_ids=req_ids,
            input_ids=int_tensor(ids),
            positions=int_tensor(positions),
            slot_mapping=int_tensor(slots),
            seq_lens=[1] * n,
            block_tables=pad_block_tables(tables),
            context_lens=int_tensor([p + 1 for p in positions], torch.int32),
            last_token_index=torch.arange(n),
            prefix_lens=[],
        )
        return self.place(inputs)

    @torch.inference_mode()
    def run(self, inputs: Inputs, keep_hidden: bool = False) -> torch.Tensor:
        """Forward one step; return float32 logits [N, vocab] for each sequence's last token.
        `keep_hidden`: keep every position's hidden state for `prompt_logits` (prefill only).
        A decode step replays a CUDA graph where the runner has them (`use_graphs`)."""
        if self.graphs is not None and inputs.phase is Phase.DECODE:
            logits = self.graphs.run(inputs)
            if logits is not None:
                self.hidden = None
                return logits
        return self.forward(inputs, keep_hidden)

    def use_graphs(self, scratch_block: int, max_blocks: int, capture: bool = True) -> None:
        """Replay decode steps from CUDA graphs (common/engine/decode_graphs.py) from now on.
        `scratch_block`: a block of the KV pools no request owns; `max_blocks`: the widest block
        table. `capture=False`: the same padded steps, run eagerly (the CPU's tests)."""
        from common.engine.decode_graphs import DecodeGraphs  # imports this module

        self.graphs = DecodeGraphs(
            self.forward, self.device, scratch_block, self.kv_cache.block_size, max_blocks,
            capture=capture,
        )  # fmt: skip

    def forward(self, inputs: Inputs, keep_hidden: bool = False) -> torch.Tensor:
        """`run`'s eager forward (what a decode graph captures). A local decode step takes the
        fused layers where they apply (`fused_decode`), and the LM head with them where it is
        on the extension's panels: the same bits, one extension call."""
        x = self.model.embed(inputs.input_ids)  # [T, hidden]
        fused = self.fused_decode(inputs, x)
        if fused is not None and fused.head is not None and not keep_hidden:
            # The layers, the final norm and the LM head in one call (one row per sequence).
            self.hidden = None
            return fused.run_logits(
                x, inputs.positions, inputs.slot_mapping, inputs.block_tables, inputs.context_lens
            )
        if fused is not None:
            x = fused.run(
                x, inputs.positions, inputs.slot_mapping, inputs.block_tables, inputs.context_lens
            )
        else:
            rope = self.model.rotary_at(inputs.positions)
            for i, layer in enumerate(self.model.layers):
                q, k, v = layer.pre_attention(x, rope)
                attn = self.attend(i, q, k, v, inputs)  # [T, Hq, D]
                x = layer.post_attention(x, attn)
        self.hidden = x if keep_hidden else None
        # One row per sequence already when every sequence has one token (decode): no gather.
        last = x if x.shape[0] == len(inputs.last_token_index) else x[inputs.last_token_index]
        return self.model.compute_logits(last)

    def fused_decode(self, inputs: Inputs, x: torch.Tensor) -> FusedDecode | None:
        """The fused decoder layers for this step, or None where its layers run stage by stage:
        not a decode step, a runner whose `attend` is not the local one (`LOCAL_ATTEND`), or what
        `FusedDecode` does not take (built on the first decode step, again after a repack or for
        another cache; a refusal is tried again only after a repack)."""
        if inputs.phase is not Phase.DECODE or not FusedDecode.takes(x):
            return None
        return self._current_fused()

    def _current_fused(self) -> FusedDecode | None:
        """The fused layers of this runner's local decode steps, built or rebuilt as needed; None
        where fusing is off, attention is not local, or `FusedDecode.build` refuses."""
        if not self.fuse_decode or not self.LOCAL_ATTEND:
            return None
        fused = self._fused
        if fused is None or not fused.current(self.kv_cache):
            generation = pack_generation()
            if self._fused_refused_at == generation:  # the same weights it refused
                return None
            fused = self._fused = FusedDecode.build(self.model, self.kv_cache, self.backend)
            self._fused_refused_at = None if fused is not None else generation
        return fused

    def takes_greedy_steps(self, num_rows: int) -> bool:
        """Whether a decode batch of `num_rows` greedy rows can run several steps in one call
        (`greedy_steps`): the fused layers and LM head of a local decode (which `FusedDecode`
        builds for a float32 model on the CPU only), not replayed from graphs."""
        if self.graphs is not None or not 0 < num_rows <= POST_ATTENTION_MAX_ROWS:
            return False
        fused = self._current_fused()
        return fused is not None and fused.greedy

    @torch.inference_mode()
    def greedy_steps(
        self, batch: Batch, token_ids: Mapping[str, Sequence[int]], num_steps: int
    ) -> list[list[int]]:
        """`num_steps` decode steps of a batch of greedy rows in one call (`takes_greedy_steps`
        first; the blocks must hold every step's token): each step's token per sequence, the
        argmax of its logits as `run` and the sampler would make them, [step][sequence]. The
        first step's input is each sequence's last token; its KV slots and those after it come
        from its block table."""
        seqs = batch.seqs
        tables = [self.blocks.block_table(s.req_id) for s in seqs]
        starts = [s.num_tokens - 1 for s in seqs]  # the first step's input positions
        positions = [p + step for step in range(num_steps) for p in starts]  # [S, N] row-major
        slots = token_slots(tables * num_steps, positions, self.blocks.block_size)
        n = len(seqs)
        fused = self._current_fused()
        assert fused is not None, "takes_greedy_steps first"
        tokens = fused.run_greedy(
            int_tensor([token_ids[s.req_id][p] for s, p in zip(seqs, starts, strict=True)]),
            int_tensor(positions).view(num_steps, n),
            int_tensor(slots).view(num_steps, n),
            pad_block_tables(tables),
            int_tensor([p + 1 for p in positions], torch.int32).view(num_steps, n),
        )
        self.hidden = None
        return tokens.tolist()

    @torch.inference_mode()
    def prompt_logprobs(
        self, inputs: Inputs, num_top: list[int | None]
    ) -> list[list[TokenLogprobs] | None]:
        """After `run(inputs, keep_hidden=True)` of a prefill: for each sequence whose `num_top`
        is set, the logprobs of its tokens after the first (each given those before it), with
        that many top alternatives; None for the others."""
        assert self.hidden is not None, "run(keep_hidden=True) first"
        result: list[list[TokenLogprobs] | None] = []
        start = 0
        for seq_len, k in zip(inputs.seq_lens, num_top, strict=True):
            if k is None:
                result.append(None)
            else:
                # Position i's logits predict token i + 1.
                chosen = inputs.input_ids[start + 1 : start + seq_len].tolist()
                hidden = self.hidden[start : start + seq_len - 1]  # [seq_len - 1, hidden]
                result.append(self._chunked_logprobs(hidden, chosen, k))
            start += seq_len
        return result

    def _chunked_logprobs(
        self, hidden: torch.Tensor, chosen: list[int], num_top: int
    ) -> list[TokenLogprobs]:
        """`token_logprobs` of `hidden`'s rows, PROMPT_LOGPROBS_CHUNK rows at a time: the logits
        and their log-softmax are [chunk, vocab] whatever the prompt's length (a whole long
        prompt's would be gigabytes at a large vocabulary). Each row's values are its own."""
        out: list[TokenLogprobs] = []
        for a in range(0, len(chosen), PROMPT_LOGPROBS_CHUNK):
            b = min(a + PROMPT_LOGPROBS_CHUNK, len(chosen))
            logits = self.model.compute_logits(hidden[a:b])  # [b - a, vocab]
            out += token_logprobs(logits, chosen[a:b], [num_top] * (b - a))
        return out

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: Inputs
    ) -> torch.Tensor:
        """Store this step's k/v in the local cache and attend over it."""
        self.kv_cache.write(layer, k, v, inputs.slot_mapping)
        if inputs.phase is Phase.PREFILL:
            # Fresh prompts' whole context is in q/k/v; a cached prefix's is in the cache only.
            return prefix_prefill_attention(
                q, k, v, self.kv_cache.key_layers[layer], self.kv_cache.value_layers[layer],
                inputs.seq_lens, inputs.prefix_lens, inputs.block_tables, self.model.scale,
            )  # fmt: skip
        out, _ = self.backend.decode(
            q,
            self.kv_cache.key_layers[layer],
            self.kv_cache.value_layers[layer],
            inputs.block_tables,
            inputs.context_lens,
            self.model.scale,
        )
        return out


# The `array` typecode of each integer dtype a step's tensors have.
_TYPECODES = {torch.int64: "q", torch.int32: "i"}


def int_tensor(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """values as a 1-D tensor of `dtype` (int64 or int32). NOTE: through an `array`, whose
    buffer the tensor then holds: a few times faster than `torch.tensor`, which inspects every
    element's Python type. A value out of the dtype's range raises OverflowError (there a
    RuntimeError)."""
    if not values:  # frombuffer refuses an empty buffer
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array(_TYPECODES[dtype], values), dtype=dtype)


def token_slots(tables: list[list[int]], positions: list[int], block_size: int) -> list[int]:
    """Each position's flat KV slot through its block table (`BlockManager.slots`' formula for
    one token: its block's first slot plus the offset), position i through tables[i]."""
    return [
        t[p // block_size] * block_size + p % block_size
        for t, p in zip(tables, positions, strict=True)
    ]


def pad_block_tables(tables: list[list[int]]) -> torch.Tensor:
    """Block tables as one [N, max_blocks] int32 tensor, padded with block 0 (never read)."""
    width = max(max(map(len, tables), default=0), 1)
    flat: list[int] = []  # one flat list, one copy into the tensor
    for t in tables:
        flat += t
        flat += [0] * (width - len(t))
    return int_tensor(flat, torch.int32).view(len(tables), width)
