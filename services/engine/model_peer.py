"""A model peer: a replica of the model's weights that runs layer slices of a token engine's decode
lanes (Lamina 4.3, rotational staggered pipelining over n - 1 model replicas).

Slice k of a lane is the post_attention of layer k - 1 (k > 0) and the pre_attention of layer
k: everything between two attention round trips. The token engine (services/engine/rotation.py)
sends a lane's context (x, positions, the previous layer's attention output) and gets (x, q, k,
v) back. `ModelPeer` is the plain class; `services/engine/model_peer_worker.py` serves it on one
UCX channel. A peer keeps no state between slices: any slice of any lane can run on it.
"""

from __future__ import annotations

import time

import torch

from common.model.llama import LlamaForCausalLM, RopeAt
from common.protocol import SliceRequest, SliceResult

Slice = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # x, q, k, v


def run_slice(
    model: LlamaForCausalLM,
    layer: int,
    x: torch.Tensor,
    rope: RopeAt,
    attn_out: torch.Tensor | None,
) -> Slice:
    """Slice `layer` of a lane: x [N, hidden] (layer - 1's input; embeddings at layer 0) and
    layer - 1's attn_out [N, Hq, D] -> this layer's input x [N, hidden], q [N, Hq, D], k and
    v [N, Hkv, D]. The one definition of a slice: the engine's local slices run it too, so a
    slice gives the same numbers wherever it runs."""
    if attn_out is not None:
        x = model.layers[layer - 1].post_attention(x, attn_out)
    q, k, v = model.layers[layer].pre_attention(x, rope)
    return x, q, k, v


class ModelPeer:
    """Runs slices for one token engine's lanes; every input is checked (a wrong one is answered
    with an error, never run)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.num_slices = 0

    @torch.inference_mode()
    def answer(
        self, request: SliceRequest, tensors: list[torch.Tensor]
    ) -> tuple[SliceResult, list[torch.Tensor]]:
        """The reply to one `SliceRequest`: the slice's (x, q, k, v), or an error and no buffers."""
        started = time.perf_counter()
        try:
            x, q, k, v = self.run_slice(request.layer, *self._inputs(request, tensors))
        except Exception as exc:  # noqa: BLE001 - the engine gets an answer, and runs it itself
            return SliceResult(request.step, request.lane, request.layer, error=repr(exc)), []
        self.num_slices += 1
        run_s = time.perf_counter() - started
        return SliceResult(request.step, request.lane, request.layer, run_s=run_s), [x, q, k, v]

    def run_slice(
        self, layer: int, x: torch.Tensor, positions: torch.Tensor, attn_out: torch.Tensor | None
    ) -> Slice:
        return run_slice(self.model, layer, x, self.model.rotary_at(positions), attn_out)

    def _inputs(
        self, request: SliceRequest, tensors: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(x, positions, attn_out) of a request, or ValueError if they do not fit the model."""
        mc = self.model.config
        if not 0 <= request.layer < mc.num_hidden_layers:
            raise ValueError(f"layer {request.layer} of a {mc.num_hidden_layers}-layer model")
        if len(tensors) != 2 + (request.layer > 0):
            raise ValueError(f"{len(tensors)} buffers for a layer-{request.layer} slice")
        x, positions = tensors[0], tensors[1]
        rows = x.shape[0]
        if not rows or x.shape != (rows, mc.hidden_size) or positions.shape != (rows,):
            raise ValueError(f"x {tuple(x.shape)}, positions {tuple(positions.shape)}")
        # NOTE: an out-of-range position would index past the RoPE tables (native code).
        if positions.dtype != torch.int64 or not (
            0 <= positions.min() and positions.max() < mc.max_position_embeddings
        ):
            raise ValueError(f"positions must be int64 in [0, {mc.max_position_embeddings})")
        if request.layer == 0:
            return x, positions, None
        attn_out = tensors[2]
        if attn_out.shape != (rows, mc.num_attention_heads, mc.head_dim):
            raise ValueError(f"attn_out {tuple(attn_out.shape)}")
        return x, positions, attn_out


__all__ = ["ModelPeer", "Slice", "run_slice"]
