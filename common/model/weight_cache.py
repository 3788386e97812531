"""Load-ready weights, written once per node and memory-mapped by every later replica.

A CPU replica's start-up spends most of `load_model` making its weights ready rather than
reading them: fusing q/k/v and gate/up, laying projections out column-major, and packing each
projection into the GEMM's panels (quantizing int8 ones). The first replica on a node writes the
result to one file (ServerlessLLM's loading-optimized checkpoint, in spirit: the bytes the model
computes on, in the order it needs them); every later replica maps that file and builds the
model on views of it, with no conversion and no packing. The mapping is private and read-only
in practice, so the replicas of a node share one copy of the weights in the page cache (less
memory per replica), and a replica that writes a weight gets its own page (copy on write),
never the file's.

Where: `MeshOptions.weight_cache` (`auto`: `<PHASEMESH_CACHE>/weights`; a directory, e.g. under
/dev/shm to keep it in memory; `off`). One file per model folder and load options, named by a
hash of its key: the folder, its files' sizes and modification times, the model and packed
dtypes, the kernel's panel width and dtypes, this module's `FORMAT_VERSION` and torch's version.

NOTE: the mapped weights sit in page-cache pages, which the kernel backs with small pages; where
transparent huge pages back a replica's own (anonymous) memory, its unmapped weights may take
fewer TLB misses. A directory on a tmpfs mounted `huge=always` gives the file huge pages too.

Faults (docs/failures.md):
- A file that is not what this load would build (truncated or partial: its size; another
  version or key: its header; corrupt bytes: a CRC-32 of the header and of the data) is never
  served: the load builds the weights as without a cache and writes the file again, logged.
- A replica that dies while writing leaves only its temporary file (written beside the cache
  file, renamed over it when complete); the next start writes it again.
- Two replicas starting at once: the first to take the file's lock builds and writes, the
  others wait on the lock and then map its file (a lock holder that dies releases it).
- A cache directory that cannot be created or written (permissions, a full disk): the load
  builds the weights as without a cache, logged; the replica starts all the same.
- The model folder changed after the file was written: its key changes, a new file is written
  (the old one stays until removed by hand).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import struct
import tempfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from common.config import ModelConfig, cache_dir
from common.model import linear
from common.model.linear import PackedLinear
from common.model.llama import LlamaForCausalLM

log = structlog.get_logger(__name__)

# Bump when what the file holds, or how a model is built from it, changes: older files are then
# rebuilt (their header's version no longer matches).
FORMAT_VERSION = 2  # 2: bfloat16 panels hold their rows in pairs (linear.pack_panels)
_MAGIC = b"PMWEIGHT"
# magic, version, header bytes, header CRC-32, data bytes, data CRC-32
_PREAMBLE = struct.Struct("<8sIQIQI")
_ALIGN = 64  # every tensor starts on a cache line (the kernel's panels are read in vectors)
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16,
                                                      torch.float16, torch.int8)}  # fmt: skip


def _aligned(n: int) -> int:
    """n rounded up to a multiple of `_ALIGN`."""
    return -(-n // _ALIGN) * _ALIGN


class CacheMismatch(ValueError):
    """A cache file that is not what this load would build (why, in its message)."""


def cache_key(folder: Path, config: ModelConfig, weight_dtype: str | None, packed: bool) -> dict:
    """Everything the built weights depend on: two loads with equal keys build equal bytes."""
    folder = folder.resolve()
    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".json"))
    return {
        "format": FORMAT_VERSION,
        "folder": str(folder),
        "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files],
        "dtype": config.dtype,
        "weight_dtype": weight_dtype or config.dtype,
        "packed": packed,
        "panel_width": linear.PANEL_WIDTH,
        "kernel_dtypes": list(linear.KERNEL_WEIGHT_DTYPES),
        "torch": torch.__version__,
    }


def cache_path(directory: Path, folder: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return directory / f"{folder.resolve().name}-{digest}.weights"


def load_or_build(
    directory: Path, folder: Path, key: dict, build: Callable[[], LlamaForCausalLM]
) -> LlamaForCausalLM:
    """The model from its cache file under `directory` when that file is valid for `key`, else
    `build()`'s, written there for the next replica (see the module for every fault)."""
    path = cache_path(directory, folder, key)
    config = ModelConfig.from_folder(folder, key["dtype"])
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "a")  # noqa: SIM115 (held below, closed by with)
    except OSError as exc:  # no directory, no permission: load as without a cache
        log.warning("weight cache unusable: weights built in this replica alone",
                    path=str(path), error=repr(exc))  # fmt: skip
        return build()
    with lock:  # closing it releases the lock; so does the kernel if this process dies
        fcntl.flock(lock, fcntl.LOCK_EX)
        model = _read_valid(path, key, config)
        if model is not None:
            # The message a load from the checkpoint logs (loader.py): each load says it once.
            log.info("model loaded", folder=str(folder), layers=config.num_hidden_layers,
                     dtype=config.dtype, weight_cache=str(path))  # fmt: skip
            return model
        model = build()
        try:
            write(path, model, key)
        except (OSError, CacheMismatch) as exc:  # a full disk; weights this file cannot hold
            log.warning("weights not cached", path=str(path), reason=repr(exc))
        else:
            log.info("weight cache written", path=str(path), bytes=path.stat().st_size)
        return model


def _read_valid(path: Path, key: dict, config: ModelConfig) -> LlamaForCausalLM | None:
    """The cached model, or None (no file, or one rebuilt for the reason logged)."""
    if not path.is_file():
        return None
    try:
        return read(path, key, config)
    except (CacheMismatch, OSError, ValueError) as exc:  # ValueError: a header that is not JSON
        log.warning("weight cache file rejected, rebuilding", path=str(path), reason=repr(exc))
        return None


# -- the file -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    """One tensor's place in the file: its bytes are `dense`'s, a C-contiguous tensor; the
    tensor itself is `dense.t()` where `transposed` (column-major projection weights)."""

    name: str
    dtype: str
    shape: list[int]  # dense's
    transposed: bool
    offset: int  # from the data's start
    nbytes: int


def _tensors(model: LlamaForCausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    """What the file holds: the parameters by state_dict name (a tied head once, as the
    embedding), and each projection's kernel panels and int8 scales (`<module>.panels`)."""
    tied = model.config.tie_word_embeddings
    for name, tensor in model.state_dict().items():
        if not (tied and name == "lm_head.weight"):
            yield name, tensor
    for name, module in model.named_modules():
        if isinstance(module, PackedLinear) and module.packed is not None:
            raise CacheMismatch(f"{name}: oneDNN's packed layout is this process's, not cached")
        if isinstance(module, PackedLinear) and module.panels is not None:
            yield name + ".panels", module.panels
            if module.scales is not None:
                yield name + ".scales", module.scales


def _dense(tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
    if tensor.is_contiguous():
        return tensor, False
    if tensor.dim() == 2 and tensor.t().is_contiguous():
        return tensor.t(), True
    raise CacheMismatch(f"a tensor of strides {tensor.stride()} has no dense layout to store")


def write(path: Path, model: LlamaForCausalLM, key: dict) -> None:
    """Write `model`'s load-ready weights to `path` atomically: a temporary file beside it,
    renamed over it once complete."""
    entries, blobs, offset = [], [], 0
    for name, tensor in _tensors(model):
        dense, transposed = _dense(tensor.detach())
        data = dense.reshape(-1).view(torch.uint8).numpy().data  # a memoryview of its bytes
        entries.append(_Entry(name, str(dense.dtype).removeprefix("torch."), list(dense.shape),
                              transposed, offset, data.nbytes))  # fmt: skip
        blobs.append((offset, data))
        offset += _aligned(data.nbytes)
    modules = {name: module.weight_dtype for name, module in model.named_modules()
               if isinstance(module, PackedLinear) and module.panels is not None}  # fmt: skip
    header = json.dumps({"key": key, "entries": [e.__dict__ for e in entries],
                         "panels_dtype": modules}).encode()  # fmt: skip
    start = _aligned(_PREAMBLE.size + len(header))
    crc, end = 0, 0
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.name, suffix=".tmp",
                                     delete=False) as f:  # fmt: skip
        try:
            f.seek(start)
            for at, data in blobs:
                pad = bytes(at - end)
                f.write(pad)
                f.write(data)
                crc = zlib.crc32(data, zlib.crc32(pad, crc))
                end = at + data.nbytes
            f.seek(0)
            f.write(_PREAMBLE.pack(_MAGIC, FORMAT_VERSION, len(header), zlib.crc32(header),
                                   end, crc))  # fmt: skip
            f.write(header)
            f.flush()
            os.fchmod(f.fileno(), 0o644)  # readable as a model folder is (a temp file is 0600)
            os.replace(f.name, path)
        except BaseException:
            os.unlink(f.name)
            raise


def read(path: Path, key: dict, config: ModelConfig) -> LlamaForCausalLM:
    """The model built on views of `path`'s mapped bytes; raises `CacheMismatch` when the file
    is not exactly what a load with `key` would build."""
    size = path.stat().st_size
    if size < _PREAMBLE.size:
        raise CacheMismatch(f"{size} bytes: shorter than its preamble")
    mapped = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
    raw = mapped.numpy()
    magic, version, header_len, header_crc, data_len, data_crc = _PREAMBLE.unpack(
        raw[: _PREAMBLE.size].tobytes()
    )
    if magic != _MAGIC or version != FORMAT_VERSION:
        raise CacheMismatch(f"format {magic!r} v{version}, this build reads v{FORMAT_VERSION}")
    header_bytes = raw[_PREAMBLE.size : _PREAMBLE.size + header_len].tobytes()
    if len(header_bytes) != header_len or zlib.crc32(header_bytes) != header_crc:
        raise CacheMismatch("header truncated or corrupt")
    header = json.loads(header_bytes)
    if header["key"] != key:
        raise CacheMismatch("written for another model, dtype or kernel layout")
    start = _aligned(_PREAMBLE.size + header_len)
    if size != start + data_len:
        raise CacheMismatch(f"{size} bytes, its header says {start + data_len}: truncated")
    data = mapped[start:]
    if zlib.crc32(raw[start:].data) != data_crc:
        raise CacheMismatch("data corrupt (CRC-32)")
    try:
        tensors = {e["name"]: _view(data, _Entry(**e)) for e in header["entries"]}
        return _build(config, tensors, header["panels_dtype"])
    except (KeyError, TypeError, RuntimeError) as exc:
        # A header whose checksums hold but whose entries do not fit its data or the model
        # (a bug in a writer, or a forged file): refused like any other mismatch.
        raise CacheMismatch(f"its entries do not fit its data or the model: {exc!r}") from exc


def _view(data: torch.Tensor, entry: _Entry) -> torch.Tensor:
    raw = data[entry.offset : entry.offset + entry.nbytes]
    dense = raw.view(_DTYPES[entry.dtype]).view(entry.shape)
    return dense.t() if entry.transposed else dense


def _build(
    config: ModelConfig, tensors: dict[str, torch.Tensor], panels_dtype: dict[str, Any]
) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    state = {n: t for n, t in tensors.items() if not n.endswith((".panels", ".scales"))}
    if config.tie_word_embeddings:  # the tie kept, as `load_model` keeps it
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    for name, module in model.named_modules():
        if name in panels_dtype and isinstance(module, PackedLinear):
            module.adopt_panels(panels_dtype[name], tensors[name + ".panels"],
                                tensors.get(name + ".scales"))  # fmt: skip
    return model.eval().requires_grad_(False)


def main() -> None:
    """`python -m common.model.weight_cache MODEL`: write MODEL's load-ready weights to this
    node's cache now (what its first replica would do), so that every replica maps them."""
    import argparse

    from common.model.default import default_model_path
    from common.model.loader import load_model

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("model", help="a Hugging Face model folder, or a preset's name")
    parser.add_argument("--cache", default="auto", help="as MeshOptions.weight_cache: auto or a "
                        "directory (default: auto, <PHASEMESH_CACHE>/weights)")  # fmt: skip
    args = parser.parse_args()
    directory = cache_dir(args.cache)
    if directory is None:
        raise SystemExit("--cache off writes nothing")
    folder = Path(args.model) if Path(args.model).is_dir() else default_model_path(args.model)
    load_model(folder, weight_cache=directory)  # the engines' load: the same key, the same file
    print(directory)


if __name__ == "__main__":
    main()
