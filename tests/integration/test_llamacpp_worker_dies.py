"""bench/engine.py when llama.cpp's worker dies (bench/llamacpp.py), starting or mid-run after it
said it was ready, or hangs mid-run: the bench keeps PhaseMesh's figures, says why the side
failed (with the worker's last words), and leaves the llama.cpp targets unjudged rather than
losing (or never ending) the run.

The worker here is a stand-in, named so: a script in place of the llama.cpp environment's
python (llama.cpp is not in this environment), which dies of a signal as llama.cpp's worker did
(SIGILL on an AMX CPU) or would (a kill), or stops answering."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from bench import llamacpp
from tests.bench_runs import assert_figures_and_targets, run_bench

DIES_STARTING = """#!/bin/sh
echo 'stand-in worker: illegal instruction while loading' >&2
kill -ILL $$
"""
DIES_MID_RUN = """#!/bin/sh
echo '{"ready": "stand-in", "system": "none"}'
read request
echo 'stand-in worker: killed mid-decode' >&2
kill -KILL $$
"""
HANGS_MID_RUN = """#!/bin/sh
echo '{"ready": "stand-in", "system": "none"}'
read request
echo 'stand-in worker: stuck mid-decode' >&2
exec sleep 3600
"""


@pytest.mark.usefixtures("tiny_model_path")
@pytest.mark.parametrize(
    ("script", "why", "last_words"),
    [
        (DIES_STARTING, "worker exited", "illegal instruction"),
        (DIES_MID_RUN, "worker exited", "killed mid-decode"),
        (HANGS_MID_RUN, "worker hung (no answer in 10 s), killed", "stuck mid-decode"),
    ],
    ids=["starting", "mid-run", "hung"],
)
def test_the_engine_bench_outlives_llamacpps_worker(
    script: str, why: str, last_words: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(script)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(llamacpp, "VENV", tmp_path / "venv")
    if script is HANGS_MID_RUN:  # long enough for a shell's first line on a loaded machine
        monkeypatch.setattr(llamacpp, "ANSWER_TIMEOUT_S", 10.0)
    monkeypatch.setattr(llamacpp, "skip_reason", lambda path: None)
    files = {kind: tmp_path / f"{kind}.gguf" for kind in llamacpp.GGUF_TYPES}
    monkeypatch.setattr(llamacpp, "gguf_files", lambda types=llamacpp.GGUF_TYPES: files)
    monkeypatch.setattr(llamacpp, "describe_gguf", lambda path: {"stand_in": path.name})

    result = run_bench(["bench/engine.py", "--model", "tiny", "--batches", "1", "--repeats", "1",
                        "--weight-dtype-repeats", "1", "--no-unpacked", "--no-onednn"])  # fmt: skip

    failed = result["llamacpp"]["failed"]
    assert why in failed and last_words in failed, failed
    assert result["batches"]["1"]["engine_tok_s"] > 0
    assert result["batches"]["1"]["transformers_tok_s"] > 0
    assert_figures_and_targets(result)
    for kind in ("f32", "f32_kv16", "bf16", "bf16_medium"):
        assert result["targets"][f"over_llamacpp_{kind}_batch_1"] == ">= 1.0"
        assert result["targets_met"][f"over_llamacpp_{kind}_batch_1"] is None
