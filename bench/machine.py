"""The machine a bench ran on, as its JSON names it (`cpu`).

Issue 54's targets are judged per CPU variant: the 2-core machines come as AMD EPYC or Intel Xeon
variants, and a kernel's share of the read probe, or a runtime's CPU per token, differs between
them. A virtual machine's model name often says only "Intel(R) Xeon(R) Processor", so the
variant is the vendor with the family and model numbers, beside the ISA features the kernels
choose their paths by.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

# The features csrc/ and torch pick kernels by (isa_select.cpp: AVX-512 over AVX2), and those
# that would change what a bfloat16 or int8 kernel could use.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def cpu_variant(cpuinfo: str | None = None) -> dict[str, Any]:
    """`vendor`, `model_name`, `family`, `model`, `isa` (the features of `ISA_FLAGS` it has) and
    `logical_cpus`, from `cpuinfo` (default: /proc/cpuinfo's first processor). Where there is
    no /proc/cpuinfo, what `platform` says."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block is enough: they are all one variant here
            continue
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    flags = set(fields.get("flags", "").split())
    return {
        "vendor": fields.get("vendor_id", platform.machine()),
        "model_name": fields.get("model name", platform.processor() or platform.machine()),
        "family": _int_or_none(fields.get("cpu family")),
        "model": _int_or_none(fields.get("model")),
        "isa": [flag for flag in ISA_FLAGS if flag in flags],
        "logical_cpus": os.cpu_count(),
    }


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None
