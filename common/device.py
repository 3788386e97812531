"""Where an engine computes: `device: auto | cpu | cuda[:N]`, decided once, at construction.

An engine on a CUDA device holds its weights (bfloat16), its own paged KV and its dense compute
there, samples where its logits are, and attends through `common.attention.device_paged`. The
CPU path is the one the project has always run: an engine on the CPU checks no device anywhere
in its step loop (each part decides from `torch.device` when it is built).

`HostStaging` is the one crossing between a device engine and the host: q/k/v for host-memory
attention shards (Lamina's split) and KV shipped from a device prompt engine leave device memory
through pinned host buffers, and the shards' outputs come back the same way. On the CPU it is the
identity (no copy, no allocation).
"""

from __future__ import annotations

import re

import torch

DEVICE_PATTERN = r"^(auto|cpu|cuda(:[0-9]+)?)$"
_DEVICE_RE = re.compile(DEVICE_PATTERN)


def resolve_device(spec: str = "auto") -> torch.device:
    """`auto` (CUDA when this process sees a GPU, else the CPU), `cpu`, `cuda` or `cuda:N` as a
    `torch.device`; ValueError for another spelling, or for a CUDA device this process lacks
    (on Ray, a replica sees the GPUs its `num_gpus` gave it, as `cuda:0` on)."""
    if not _DEVICE_RE.match(spec):
        raise ValueError(f"device {spec!r}: expected auto, cpu, cuda or cuda:N")
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {spec!r}: CUDA is not available in this process")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"device {spec!r}: this process sees {torch.cuda.device_count()} CUDA device(s)"
            )
        device = torch.device("cuda", index)
    return device


def model_dtype_on(device: torch.device, dtype: str | None) -> str | None:
    """The model dtype an engine on `device` runs: bfloat16 on a GPU unless one was asked, the
    checkpoint's own (None) or the one asked on the CPU."""
    if device.type == "cuda" and dtype is None:
        return "bfloat16"
    return dtype


class HostStaging:
    """Tensors across the device/host edge through pinned buffers (non-blocking copies, one
    synchronisation per crossing). On the CPU every method returns its input: the copies are
    explicit and skipped there.

    Faults: a copy that fails (device lost, out of pinned memory) raises here, in the step that
    asked, which fails as any step error does; nothing is half-sent (the send comes after)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.on_device = device.type != "cpu"

    def to_host(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor in pinned host memory (its strides kept where dense), ready to send: the
        copies are queued without blocking, then the device is waited on once for all."""
        if not self.on_device:
            return list(tensors)
        host = [
            torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
            for t in tensors
        ]
        torch.cuda.current_stream(self.device).synchronize()
        return host

    def host_buffer(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An empty host tensor for replies to land in: pinned on a device engine, so that
        `to_device` can copy it without blocking."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.on_device)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (host memory) on the engine's device; non-blocking from pinned memory (the caching
        host allocator keeps the buffer until the copy is done)."""
        if not self.on_device:
            return t
        return t.to(self.device, non_blocking=True)


__all__ = ["DEVICE_PATTERN", "HostStaging", "model_dtype_on", "resolve_device"]
