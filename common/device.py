"""Where an engine computes: `device: auto | cpu | cuda[:N]`, decided once, at construction.

An engine on a CUDA device holds its weights (bfloat16), its own paged KV and its dense compute
there, samples where its logits are, and attends through `common.attention.device_paged`. The
CPU path is the one the project has always run: an engine on the CPU checks no device anywhere
in its step loop (each part decides from `torch.device` when it is built).

`HostStaging` is the one crossing between a device engine and the host: q/k/v for host-memory
attention shards (Lamina's split) and KV shipped from a device prompt engine leave device memory
through pinned host buffers, and the shards' outputs come back the same way, on a CUDA stream of
its own so that the copies overlap the engine's compute. On the CPU it is the identity (no copy,
no allocation, no stream).
"""

from __future__ import annotations

import re

import torch

from common.mesh_options import DEVICE_PATTERN

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


class StagedCopy:
    """Copies to pinned host memory under way on the staging stream; `wait` blocks until they
    (and only they) are done: compute queued on the engine's stream after them runs on."""

    def __init__(self, host: list[torch.Tensor], done: torch.cuda.Event | None) -> None:
        self.host = host
        self.done = done

    def wait(self) -> list[torch.Tensor]:
        if self.done is not None:
            self.done.synchronize()
        return self.host


class HostStaging:
    """Tensors across the device/host edge through pinned buffers, on a stream of their own. On
    the CPU every method returns its input: the copies are explicit and skipped there.

    On a device, `stage` queues the device-to-host copies on the staging stream behind what the
    engine's stream has queued so far and returns at once; the engine queues more compute (the
    next sub-batch's or lane's dense work, the local rows' attention) and then `wait`s for the
    copies alone before sending them, so the copies overlap that compute. `to_device` queues the
    replies' host-to-device copy on the staging stream and makes the engine's stream wait for it
    by an event: no host synchronisation, the next layer's kernels queue behind it.

    Faults: a copy that fails (device lost, out of pinned memory) raises here, in the step that
    asked, which fails as any step error does; nothing is half-sent (the send comes after)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.on_device = device.type != "cpu"
        self.stream = torch.cuda.Stream(device) if self.on_device else None

    def stage(self, *tensors: torch.Tensor) -> StagedCopy:
        """Each tensor's copy to pinned host memory (its strides kept where dense), queued; the
        sources stay allocated until the copies have read them."""
        if self.stream is None:
            return StagedCopy(list(tensors), None)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # after their producers
        with torch.cuda.stream(self.stream):
            host = [
                torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                for t in tensors
            ]
            done = torch.cuda.Event()
            done.record(self.stream)
        for t in tensors:
            t.record_stream(self.stream)
        return StagedCopy(host, done)

    def to_host(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor in pinned host memory, ready to send (`stage`, then `wait`)."""
        if not self.on_device:
            return list(tensors)
        return self.stage(*tensors).wait()

    def host_buffer(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An empty host tensor for replies to land in: pinned on a device engine, so that
        `to_device` can copy it without blocking."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.on_device)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (host memory) on the engine's device: copied on the staging stream, the engine's
        stream ordered after it (the caching host allocator keeps `t` until the copy is done)."""
        if self.stream is None:
            return t
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            out = t.to(self.device, non_blocking=True)
        compute.wait_stream(self.stream)
        out.record_stream(compute)
        return out


__all__ = ["HostStaging", "StagedCopy", "model_dtype_on", "resolve_device"]
