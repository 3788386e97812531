"""The Llama decoder as small layer classes named like Hugging Face's modules.

Each decoder layer is split into three stages so that disaggregation is explicit, not patched in:

    q, k, v = layer.pre_attention(x, rope)           # norm, fused QKV projection, RoPE
    attn    = <attention, local or on shards>        # the only stage that reads the KV cache
    x       = layer.post_attention(x, attn)          # O projection, residual, norm, SwiGLU MLP

Projections are fused at load time (q/k/v -> qkv_proj, gate/up -> gate_up_proj, see loader.py);
module names otherwise match `transformers`' LlamaForCausalLM so checkpoints load by name.
"""

from __future__ import annotations

import math
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from common.config import ModelConfig, RopeScaling
from common.model import layer_ops, linear
from common.model.linear import PackedLinear


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32, cast back, then scale, as transformers does; one fused pass where
        # the extension is built (on a small model, decode time is op count).
        return layer_ops.rms_norm(x, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """RoPE inverse frequencies, with Llama-3's frequency-dependent scaling when configured."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables, indexed by absolute position."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # NOTE: on the CPU even where the model's skeleton is built on the meta device
        # (`load_model`): the tables are not in the checkpoint, and ops on meta tensors go through
        # torch's Python reference ops, whose first call imports torch._dynamo, a slow import that
        # every start-up would pay.
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
            positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
            freqs = torch.outer(positions, inv_freq)  # [max_pos, head_dim / 2]
            emb = torch.cat([freqs, freqs], dim=-1)  # [max_pos, head_dim]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def at(self, positions: torch.Tensor) -> RopeAt:
        """RoPE at one step's `positions` [T]; built once per step and shared by every layer."""
        return RopeAt(positions.long(), self.cos, self.sin)


class RopeAt(NamedTuple):
    """One step's positions [T] and the float32 cos/sin tables [max_pos, head_dim]."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

    def rotate_heads_(self, rows: torch.Tensor, num_heads: int, head_dim: int) -> None:
        """Rotate, in place, the first `num_heads` heads of each row of rows [T, W]."""
        layer_ops.rotate_heads_(rows, num_heads, head_dim, self.positions, self.cos, self.sin)


class LlamaAttention(nn.Module):
    """Only the projections: the attention itself runs wherever the KV cache lives."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = PackedLinear(config.hidden_size, qkv_out, bias=False)
        self.o_proj = PackedLinear(self.num_heads * self.head_dim, config.hidden_size, bias=False)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = PackedLinear(
            config.hidden_size, 2 * config.intermediate_size, bias=False
        )
        self.down_proj = PackedLinear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gate_up_proj's outputs are gate | up, [T, 2 * intermediate]
        return self.down_proj.forward(self.gate_up_proj.forward_silu_and_mul(x))

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + mlp(x), the add fused into the down projection where it can be."""
        return self.down_proj.forward_add(self.gate_up_proj.forward_silu_and_mul(x), residual)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def pre_attention(
        self, x: torch.Tensor, rope: RopeAt
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, num_heads, head_dim], k and v [T, num_kv_heads, head_dim].

        `rope` is `rotary.at(positions, dtype)` for the step's positions.
        """
        attn = self.self_attn
        # NOTE: functional calls, not module calls: each nn.Module call costs several us of hooks
        # bookkeeping, which a small model's decode step pays dozens of times.
        qkv = attn.qkv_proj.forward(self.input_layernorm.forward(x))
        # q and k sit side by side at the start of each qkv row: rotate both in one pass.
        rope.rotate_heads_(qkv, attn.num_heads + attn.num_kv_heads, attn.head_dim)
        q_size, kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        q = qkv[:, :q_size].view(-1, attn.num_heads, attn.head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(-1, attn.num_kv_heads, attn.head_dim)
        v = qkv[:, q_size + kv_size :].view(-1, attn.num_kv_heads, attn.head_dim)
        return q, k, v

    def pre_attention_q(self, x: torch.Tensor, rope: RopeAt) -> tuple[torch.Tensor, torch.Tensor]:
        """`pre_attention` in two halves, q first (Lamina 4.2.2: q leaves for the shards while
        k/v are computed): x [T, hidden] -> (the normed x [T, hidden] for `pre_attention_kv`,
        q [T, num_heads, head_dim])."""
        attn = self.self_attn
        h = self.input_layernorm.forward(x)
        q_size = attn.num_heads * attn.head_dim
        q = attn.qkv_proj.forward_rows(h, 0, q_size)  # [T, q_size]: the fused weight's q rows
        rope.rotate_heads_(q, attn.num_heads, attn.head_dim)
        return h, q.view(-1, attn.num_heads, attn.head_dim)

    def pack_halves(self) -> None:
        """Pack the q rows and the k/v rows `pre_attention_q` / `pre_attention_kv` run on, so an
        engine with early q pays the packing at start-up, not in its first decode step."""
        attn = self.self_attn
        q_size, kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        attn.qkv_proj.pack_rows(0, q_size)
        attn.qkv_proj.pack_rows(q_size, q_size + 2 * kv_size)

    def pre_attention_kv(self, h: torch.Tensor, rope: RopeAt) -> tuple[torch.Tensor, torch.Tensor]:
        """The second half: h [T, hidden] -> k and v [T, num_kv_heads, head_dim]."""
        attn = self.self_attn
        q_size, kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        # [T, 2 * kv_size]: k | v, the fused weight's last rows (packed apart from the q rows)
        kv = attn.qkv_proj.forward_rows(h, q_size, q_size + 2 * kv_size)
        rope.rotate_heads_(kv, attn.num_kv_heads, attn.head_dim)
        k = kv[:, :kv_size].view(-1, attn.num_kv_heads, attn.head_dim)
        v = kv[:, kv_size:].view(-1, attn.num_kv_heads, attn.head_dim)
        return k, v

    def post_attention(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], attn_out [T, num_heads, head_dim] -> the next layer's x [T, hidden]."""
        attn = attn_out.reshape(x.shape[0], -1).to(x.dtype)
        norm, mlp = self.post_attention_layernorm, self.mlp
        o_proj = self.self_attn.o_proj
        fused = linear.post_attention(
            x, attn, o_proj, norm.weight, norm.eps, mlp.gate_up_proj, mlp.down_proj
        )
        if fused is not None:  # the same bits as the calls below, in one extension call
            return fused
        o = o_proj.forward(attn)
        x, h = layer_ops.add_rms_norm(x, o, norm.weight, norm.eps)  # x + o, and its norm
        return mlp.forward_add(h, x)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int], scale: float
) -> torch.Tensor:
    """Prefill attention over fresh prompts packed back to back.

    q [T, Hq, D], k/v [T, Hkv, D] with T = sum(seq_lens) -> out [T, Hq, D]. Each sequence attends
    causally to itself only.
    """
    out = torch.empty_like(q)
    start = 0
    for seq_len in seq_lens:
        end = start + seq_len
        qs = q[start:end].transpose(0, 1)  # [Hq, L, D]
        ks, vs = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)  # [Hkv, L, D]
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        out[start:end] = o.transpose(0, 1)
        start = end
    return out


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # NOTE: `_weight`: no random init, which the checkpoint's weights replace anyway; on the
        # meta device (`load_model`) Embedding's `normal_` would import torch._dynamo (above).
        weight = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.rotary = RotaryEmbedding(config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Embeddings, the decoder layers' three stages, and the LM head; no attention state."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = PackedLinear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.scale = config.head_dim**-0.5

    @property
    def layers(self) -> list[LlamaDecoderLayer]:
        return cast(list[LlamaDecoderLayer], list(self.model.layers))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Functional: a module call's hook bookkeeping costs microseconds every step.
        return F.embedding(input_ids, self.model.embed_tokens.weight)  # [T, hidden]

    def rotary_at(self, positions: torch.Tensor) -> RopeAt:
        """RoPE at one step's positions [T] (for `pre_attention`)."""
        return self.model.rotary.at(positions)

    def compute_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] (one row per sequence) -> float32 logits [N, vocab]."""
        return self.lm_head.forward(self.model.norm.forward(x)).float()

    def forward_prefill(self, input_ids: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """Full-sequence logits [T, vocab] for packed fresh prompts; for tests and scoring."""
        positions = torch.cat([torch.arange(n) for n in seq_lens]).to(input_ids.device)
        x = self.embed(input_ids)
        rope = self.rotary_at(positions)
        for layer in self.layers:
            q, k, v = layer.pre_attention(x, rope)
            x = layer.post_attention(x, causal_attention(q, k, v, seq_lens, self.scale))
        return self.compute_logits(x)
