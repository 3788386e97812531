"""Decode attention: the backend interface, the torch reference, and the C++ kernel."""

from __future__ import annotations

import functools

import structlog
import torch

from common.attention.base import AttentionBackend, combine_partials
from common.attention.device_paged import DevicePagedAttention
from common.attention.torch_ref import TorchPagedAttention

__all__ = [
    "AttentionBackend",
    "DevicePagedAttention",
    "TorchPagedAttention",
    "combine_partials",
    "select_backend",
]

log = structlog.get_logger(__name__)


def select_backend(name: str = "auto", device: torch.device | None = None) -> AttentionBackend:
    """`auto` is the C++ kernel when it is built, else the torch reference (logged once); on a
    CUDA `device`, `auto` is the batched device backend (`device_paged`), the only one that
    reads device memory."""
    on_device = device is not None and device.type != "cpu"
    if name == "device_paged" or (name == "auto" and on_device):
        return DevicePagedAttention()
    if on_device:
        raise ValueError(f"attention backend {name!r} runs on the CPU: use auto or device_paged")
    if name == "torch":
        return TorchPagedAttention()
    try:
        from common.attention.cpu_kernel import CpuKernelAttention, kernel_available
    except ImportError as exc:
        kernel_error: str | None = str(exc)
    else:
        if kernel_available():
            return CpuKernelAttention()
        kernel_error = "the csrc extension is not built"
    if name == "cpu_kernel":
        raise RuntimeError(f"attention backend cpu_kernel is unavailable: {kernel_error}")
    if name != "auto":
        raise ValueError(
            f"unknown attention backend {name!r} (auto, cpu_kernel, torch or device_paged)"
        )
    _warn_fallback_once(kernel_error)
    return TorchPagedAttention()


@functools.cache
def _warn_fallback_once(reason: str | None) -> None:
    log.warning("C++ attention kernel unavailable; using the torch reference", reason=reason)
