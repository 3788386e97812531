"""The weight cache (common/model/weight_cache.py) on real files: a warm load maps the bytes a cold
one built, the same bytes as a load without a cache, and the engine's greedy tokens do not move;
a file that is not exactly what the load would build is rebuilt, never served."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import msgspec
import pytest
import torch

from common.config import CacheConfig, EngineConfig, ModelConfig
from common.engine.core import LLMEngine
from common.mesh_options import MeshOptions
from common.model import weight_cache
from common.model.linear import PackedLinear, kernel_gemm_available
from common.model.llama import LlamaForCausalLM
from common.model.loader import build_model, load_model
from common.sampling_params import SamplingParams
from tests.conftest import random_prompts

REPO = Path(__file__).resolve().parents[2]


def cache_file(directory: Path) -> Path:
    (path,) = directory.glob("*.weights")
    return path


def is_mapped(model: LlamaForCausalLM, path: Path) -> bool:
    """The model's weights are views of `path`'s mapping (a warm load), not tensors of its own."""
    return model.model.norm.weight.untyped_storage().nbytes() == path.stat().st_size


def assert_same_weights(a: LlamaForCausalLM, b: LlamaForCausalLM) -> None:
    """Every parameter, kernel panel and int8 scale bitwise equal, in the same layout."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].stride() == sb[name].stride(), name
        assert torch.equal(sa[name], sb[name]), name
    for (name, ma), (_, mb) in zip(a.named_modules(), b.named_modules(), strict=True):
        if isinstance(ma, PackedLinear):
            assert isinstance(mb, PackedLinear) and ma.weight_dtype == mb.weight_dtype, name
            for part in ("panels", "scales"):
                x, y = getattr(ma, part), getattr(mb, part)
                assert (x is None) == (y is None), (name, part)
                assert x is None or torch.equal(x, y), (name, part)


@pytest.mark.parametrize("weight_dtype", ["float32", "int8"])
def test_cold_and_warm_loads_give_the_same_bytes_and_greedy_tokens(
    tiny_model_path: Path, tmp_path: Path, weight_dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not kernel_gemm_available(weight_dtype):
        pytest.skip(f"this kernel build packs no {weight_dtype} panels")
    monkeypatch.setenv("PHASEMESH_WEIGHT_DTYPE", weight_dtype)
    reference = build_model(tiny_model_path, None, weight_dtype)
    cold = load_model(tiny_model_path, weight_cache=tmp_path)  # builds and writes the file
    path = cache_file(tmp_path)
    warm = load_model(tiny_model_path, weight_cache=tmp_path)
    assert not is_mapped(cold, path) and is_mapped(warm, path)
    assert_same_weights(reference, cold)
    assert_same_weights(reference, warm)

    # Greedy tokens of the single-process engine on the mapped weights, against it without.
    prompts = random_prompts([5, 23, 40], reference.config.vocab_size, seed=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engines = [
        LLMEngine(
            EngineConfig(str(tiny_model_path), CacheConfig(16, 64), weight_cache=cache),
            with_tokenizer=False,
        )  # fmt: skip
        for cache in ("off", str(tmp_path))
    ]
    assert is_mapped(engines[1].model, path)
    expected = engines[0].generate(prompts, greedy)
    assert engines[1].generate(prompts, greedy) == expected


def flip_version(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(8)  # the preamble's version, after the magic
        f.write(struct.pack("<I", weight_cache.FORMAT_VERSION + 1))


def flip_data_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size - 1000)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


def truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 4096)


def rekey(path: Path) -> None:
    """The file rewritten whole for another key (as if written for another model folder)."""
    src = path.parent.parent / "src"
    config = ModelConfig.from_folder(src, None)
    key = weight_cache.cache_key(src, config, None, True) | {"folder": "/another/model"}
    weight_cache.write(path, build_model(src, None, None), key)


def _forge_header(path: Path, edit: object) -> None:
    """The header's entries edited in place (same length) and its CRC-32 written to match: a
    file whose checksums hold but whose entries lie (a writer's bug, or a hostile file)."""
    preamble = weight_cache._PREAMBLE
    with open(path, "r+b") as f:
        fields = list(preamble.unpack(f.read(preamble.size)))
        raw = f.read(fields[2])
        header = json.loads(raw)
        edit(header["entries"])  # type: ignore[operator]
        forged = json.dumps(header).encode()
        assert len(forged) == len(raw), "the edit must keep the header's length"
        fields[3] = zlib.crc32(forged)
        f.seek(0)
        f.write(preamble.pack(*fields) + forged)


def forge_offset(path: Path) -> None:
    """The last tensor placed past the end of the data."""

    def edit(entries: list[dict]) -> None:
        entries[-1]["offset"] = int("9" * len(str(entries[-1]["offset"])))

    _forge_header(path, edit)


def forge_shape(path: Path) -> None:
    """A projection weight's shape transposed: the same bytes, a shape the model does not have."""

    def edit(entries: list[dict]) -> None:
        entry = next(e for e in entries if len(e["shape"]) == 2 and e["shape"][0] != e["shape"][1])
        entry["shape"].reverse()

    _forge_header(path, edit)


@pytest.mark.parametrize(
    "damage", [truncate, flip_version, flip_data_byte, rekey, forge_offset, forge_shape]
)
def test_a_damaged_or_stale_cache_file_is_rebuilt_never_served(
    tiny_model_path: Path, tmp_path: Path, damage: object
) -> None:
    src = tmp_path / "src"  # a copy of the model folder beside the cache (`rekey` reads it)
    src.mkdir()
    for f in tiny_model_path.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    cache = tmp_path / "cache"
    reference = load_model(src, weight_cache=cache)
    path = cache_file(cache)
    damage(path)  # type: ignore[operator]
    whole = path.stat().st_size
    with pytest.raises(weight_cache.CacheMismatch):
        key = weight_cache.cache_key(src, reference.config, None, True)
        weight_cache.read(path, key, reference.config)
    rebuilt = load_model(src, weight_cache=cache)
    assert not is_mapped(rebuilt, path)  # built, not served from the damaged file
    assert_same_weights(reference, rebuilt)
    again = load_model(src, weight_cache=cache)  # the file written anew
    assert is_mapped(again, path) and (damage is not truncate or path.stat().st_size > whole)
    assert_same_weights(reference, again)


def test_a_cache_directory_that_cannot_be_made_loads_as_without_one(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    model = load_model(tiny_model_path, weight_cache=blocker / "weights")
    assert_same_weights(build_model(tiny_model_path, None, None), model)
    assert blocker.read_text() == "not a directory"


def test_two_loads_at_once_build_once_and_the_other_maps_the_file(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    models: list[LlamaForCausalLM] = []
    threads = [
        threading.Thread(target=lambda: models.append(load_model(tiny_model_path,
                                                                 weight_cache=tmp_path)))
        for _ in range(2)
    ]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(models) == 2
    path = cache_file(tmp_path)
    assert sorted(is_mapped(m, path) for m in models) == [False, True]
    assert_same_weights(models[0], models[1])
    assert not list(tmp_path.glob("*.tmp"))


def test_weight_cache_option_takes_auto_off_or_an_absolute_directory() -> None:
    for ok in ("auto", "off", "/dev/shm/phasemesh"):
        assert msgspec.convert({"weight_cache": ok}, MeshOptions).weight_cache == ok
    with pytest.raises(msgspec.ValidationError, match="weight_cache"):
        msgspec.convert({"weight_cache": "relative/dir"}, MeshOptions)
    assert weight_cache.cache_dir("off") is None
    assert weight_cache.cache_dir("/x/y") == Path("/x/y")


_STALLED_WRITER = """
import sys, threading
from pathlib import Path
from common.model import weight_cache
from common.model.loader import load_model

def stalled_write(path, model, key):  # the replica dies in here, its lock held
    (path.parent / (path.name + ".partial.tmp")).write_bytes(b"half a file")
    Path(sys.argv[3]).touch()
    threading.Event().wait()

weight_cache.write = stalled_write
load_model(Path(sys.argv[1]), weight_cache=Path(sys.argv[2]))
"""


def test_a_writer_killed_while_it_holds_the_lock_leaves_a_cache_the_next_load_builds(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """A replica killed (SIGKILL) mid-write: its lock goes with it, only its temp file is left,
    and the next load builds, writes and is then served from the file."""
    writing = tmp_path / "writing"
    cache = tmp_path / "cache"
    child = subprocess.Popen(
        [sys.executable, "-c", _STALLED_WRITER, str(tiny_model_path), str(cache), str(writing)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        for _ in range(1200):  # a hang guard, not a speed bound
            if writing.exists() or child.poll() is not None:
                break
            time.sleep(0.1)
        assert writing.exists(), "the child never reached its write"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert not list(cache.glob("*.weights"))  # nothing half-written under the real name
    built = load_model(tiny_model_path, weight_cache=cache)  # the dead replica's lock is free
    path = cache_file(cache)
    served = load_model(tiny_model_path, weight_cache=cache)
    assert not is_mapped(built, path) and is_mapped(served, path)
    assert_same_weights(built, served)
