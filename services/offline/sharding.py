"""One offline worker's two shardings of the model (Seesaw §4.1), and the forward passes on them.

- Pipeline parallel (prefill): worker r of k runs layers [r*L/k, (r+1)*L/k) whole, hidden states
  passed on to worker r+1; the layers are the model's own, so a PP prefill is the single-process
  prefill split at layer boundaries.
- Tensor parallel (prefill or decode): worker r holds, for every layer, the q heads
  [r*H/k, (r+1)*H/k), the KV heads [r*Hkv/k, ...), the matching columns of o_proj, and the MLP's
  intermediate columns [r*I/k, ...) (rows of gate and up, columns of down); the partial outputs of
  o_proj and down_proj are summed over the workers (all-reduce).

Both shardings are sliced once at start-up from the one model folder (weights live in host memory
here, so a re-shard moves no weights; on devices it would reload the other sharding's slices).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.model import layer_ops
from common.model.llama import LlamaForCausalLM, RopeAt, causal_attention
from services.offline.options import check_shardable

AllReduce = Callable[[torch.Tensor], None]  # sums a tensor over the workers, in place


def pp_layers(num_layers: int, k: int, rank: int) -> range:
    per = num_layers // k
    return range(rank * per, (rank + 1) * per)


@dataclass
class TpLayer:
    """One layer's tensor-parallel slices for one worker."""

    norm1: torch.Tensor
    norm2: torch.Tensor
    eps: float
    qkv: torch.Tensor  # [(hq + 2 hk) * D, hidden]: its q heads, then its k heads, then its v
    o: torch.Tensor  # [hidden, hq * D]: o_proj's columns for its heads
    gate_up: torch.Tensor  # [2 i, hidden]: its gate rows, then its up rows
    down: torch.Tensor  # [hidden, i]


class TpShard:
    """Worker `rank`'s tensor-parallel slices of every layer."""

    def __init__(self, model: LlamaForCausalLM, k: int, rank: int) -> None:
        check_shardable(model.config, k)
        c = model.config
        d = c.head_dim
        self.hq, self.hk = c.num_attention_heads // k, c.num_key_value_heads // k
        self.head_dim, self.scale = d, model.scale
        self.kv_heads = range(rank * self.hk, (rank + 1) * self.hk)
        i = c.intermediate_size // k
        q0, k0 = c.num_attention_heads * d, (c.num_attention_heads + c.num_key_value_heads) * d
        kvw = c.num_key_value_heads * d
        self.layers = []
        for layer in model.layers:
            w = layer.self_attn.qkv_proj.weight.detach()
            qs = slice(rank * self.hq * d, (rank + 1) * self.hq * d)
            ks = slice(q0 + rank * self.hk * d, q0 + (rank + 1) * self.hk * d)
            vs = slice(k0 + rank * self.hk * d, k0 + (rank + 1) * self.hk * d)
            assert vs.stop <= k0 + kvw
            gu = layer.mlp.gate_up_proj.weight.detach()
            inter = c.intermediate_size
            self.layers.append(TpLayer(
                norm1=layer.input_layernorm.weight.detach(),
                norm2=layer.post_attention_layernorm.weight.detach(),
                eps=layer.input_layernorm.eps,
                qkv=torch.cat([w[qs], w[ks], w[vs]]).contiguous(),
                o=layer.self_attn.o_proj.weight.detach()[:, qs].contiguous(),
                gate_up=torch.cat([gu[rank * i:(rank + 1) * i],
                                   gu[inter + rank * i:inter + (rank + 1) * i]]).contiguous(),
                down=layer.mlp.down_proj.weight.detach()[:, rank * i:(rank + 1) * i].contiguous(),
            ))  # fmt: skip

    def qkv(self, n: int, x: torch.Tensor, rope: RopeAt) -> tuple[torch.Tensor, ...]:
        """Layer n's q [T, hq, D], k and v [T, hk, D] for its heads (q and k rotated)."""
        layer, d = self.layers[n], self.head_dim
        h = layer_ops.rms_norm(x, layer.norm1, layer.eps)
        qkv = F.linear(h, layer.qkv)
        rope.rotate_heads_(qkv, self.hq + self.hk, d)
        q_size, k_size = self.hq * d, self.hk * d
        q = qkv[:, :q_size].view(-1, self.hq, d)
        k = qkv[:, q_size : q_size + k_size].view(-1, self.hk, d)
        v = qkv[:, q_size + k_size :].view(-1, self.hk, d)
        return q, k, v

    def post_attention(
        self, n: int, x: torch.Tensor, attn: torch.Tensor, all_reduce: AllReduce
    ) -> torch.Tensor:
        """x + o_proj(attn) (summed over workers), then + its MLP (summed over workers)."""
        layer = self.layers[n]
        o = F.linear(attn.reshape(x.shape[0], -1), layer.o)
        all_reduce(o)
        x, h = layer_ops.add_rms_norm(x, o, layer.norm2, layer.eps)
        mlp = F.linear(layer_ops.silu_and_mul(F.linear(h, layer.gate_up)), layer.down)
        all_reduce(mlp)
        return x + mlp

    def prefill_layer(
        self, n: int, x: torch.Tensor, rope: RopeAt, seq_lens: list[int], all_reduce: AllReduce
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A TP prefill layer over packed fresh prompts: (next x, its heads' k, v)."""
        q, k, v = self.qkv(n, x, rope)
        attn = causal_attention(q, k, v, seq_lens, self.scale)
        return self.post_attention(n, x, attn, all_reduce), k, v
