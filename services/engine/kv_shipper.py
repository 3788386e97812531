"""Prefill KV on its way to where the request decodes (Splitwise §IV-C): `KvShipper` sends each
layer's k/v at once for long prompts (layer-wise, so the transfer overlaps the next layers) or keeps
them until the batch ends for short ones (serialized), split by heads over a shard group's
members or whole to a token engine (`KvRoute`), through whatever `KvSend` the engine has (UCX
`kv_ports.py`, or ZeroMQ).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from common.protocol import KvPages, ShardAddress

# (destination, header, k, v): over UCX to `kv_address`, or ZeroMQ where it has none
KvSend = Callable[[ShardAddress, KvPages, torch.Tensor, torch.Tensor], None]


@dataclass
class KvRoute:
    """Where one request's KV goes: one address per shard (heads split), or the token engine.

    The shipper also notes what it sent and when (`time.time_ns()`), for the `kv.transfer` span:
    the first send started, the last one handed to the socket, the bytes, and per page (a layer,
    or all layers when serialized) `sends`: (layer_start, num_layers, bytes, time started).
    `traceparent` (the request's trace context) travels in every page, for the receiver's span."""

    req_id: str
    destinations: list[ShardAddress]
    layer_wise: bool
    reserve_tokens: int = 0  # `KvPages.reserve_tokens`
    pending: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    num_bytes: int = 0
    first_sent_ns: int = 0
    last_sent_ns: int = 0
    traceparent: str = ""
    sends: list[tuple[int, int, int, int]] = field(default_factory=list)
    kv_generation: int = 0  # `KvPages.kv_generation`


class KvShipper:
    """Sends one prefill batch's KV to its destinations, layer-wise or serialized."""

    def __init__(self, routes: list[KvRoute], num_layers: int, send: KvSend) -> None:
        self.routes = routes
        self.num_layers = num_layers
        self.send = send
        self.last_layer_done_at = 0.0

    def on_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int]) -> None:
        """One layer's k/v [T, Hkv, D] of the batch's whole prompts, `seq_lens` tokens each."""
        start = 0
        for route, seq_len in zip(self.routes, seq_lens, strict=True):
            ks, vs = k[start : start + seq_len], v[start : start + seq_len]  # [L, Hkv, D]
            start += seq_len
            if route.layer_wise:
                self._ship(route, layer, ks.unsqueeze(0), vs.unsqueeze(0))
            else:
                route.pending.append((ks, vs))
        if layer == self.num_layers - 1:
            self.last_layer_done_at = time.monotonic()

    def finish(self) -> None:
        """End of the batch: ship the serialized requests, all layers in one message each."""
        for route in self.routes:
            if not route.layer_wise:
                k = torch.stack([kv[0] for kv in route.pending])  # [layers, L, Hkv, D]
                v = torch.stack([kv[1] for kv in route.pending])
                route.pending.clear()
                self._ship(route, 0, k, v)

    def _ship(self, route: KvRoute, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        started_ns = time.time_ns()
        route.first_sent_ns = route.first_sent_ns or started_ns
        num_bytes = route.num_bytes
        for dest in route.destinations:
            header = KvPages(
                req_id=route.req_id,
                layer_start=layer,
                num_layers=k.shape[0],
                num_tokens=k.shape[1],
                head_start=dest.head_start,
                head_end=dest.head_end,
                total_layers=self.num_layers,
                sent_at=time.monotonic(),
                reserve_tokens=route.reserve_tokens,
                traceparent=route.traceparent,
                kv_generation=route.kv_generation,
            )
            heads = slice(dest.head_start, dest.head_end)
            k_dest, v_dest = k[:, :, heads].contiguous(), v[:, :, heads].contiguous()
            self.send(dest, header, k_dest, v_dest)
            route.num_bytes += k_dest.nbytes + v_dest.nbytes
        route.last_sent_ns = time.time_ns()
        if route.traceparent:  # the `kv.send` events of its `kv.transfer` span
            route.sends.append((layer, k.shape[0], route.num_bytes - num_bytes, started_ns))


__all__ = ["KvRoute", "KvSend", "KvShipper"]
