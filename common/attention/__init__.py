"""Decode attention: the backend interface, the torch reference, and the C++ kernel."""

from __future__ import annotations

import functools

import structlog

from common.attention.base import AttentionBackend, combine_partials
from common.attention.torch_ref import TorchPagedAttention

__all__ = ["AttentionBackend", "TorchPagedAttention", "combine_partials", "select_backend"]

log = structlog.get_logger(__name__)


def select_backend(name: str = "auto") -> AttentionBackend:
    """`auto` is the C++ kernel when it is built, else the torch reference (logged once)."""
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
        raise ValueError(f"unknown attention backend {name!r} (auto, cpu_kernel or torch)")
    _warn_fallback_once(kernel_error)
    return TorchPagedAttention()


@functools.cache
def _warn_fallback_once(reason: str | None) -> None:
    log.warning("C++ attention kernel unavailable; using the torch reference", reason=reason)
