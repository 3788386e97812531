"""llama.cpp's side of bench/engine.py, run for real: skipped, at no cost, where its environment
(.venv-llamacpp, bench/llamacpp_env.sh) or SmolLM2's files are absent, as in CI.

llama.cpp on the F32 GGUF written from SmolLM2's tensors generates PhaseMesh's float32 greedy
tokens; a request the worker cannot serve is an error that leaves it serving; a dead worker's
next call raises with its log."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import llamacpp

pytestmark = [
    pytest.mark.skipif(
        not (llamacpp.VENV / "bin" / "python").is_file(),
        reason=f"no llama.cpp environment at {llamacpp.VENV} (bench/llamacpp_env.sh)",
    ),
    pytest.mark.timeout(600),
]


@pytest.fixture(scope="module")
def folder() -> Path:
    path = llamacpp.cache_root() / "models" / f"smollm2-float32-v{llamacpp.FORMAT_VERSION}"
    if not (path / "model.safetensors").is_file():
        pytest.skip(f"SmolLM2 is not prepared at {path} (make model)")
    return path


def test_llamacpp_f32_generates_phasemeshs_float32_greedy_tokens(folder: Path) -> None:
    from bench.engine import engine_tokens
    from common.engine.core import LLMEngine
    from common.tokenizer import Tokenizer

    prompts = [Tokenizer(folder).encode(t) for t in ("The capital of France is", "1, 2, 3,")]
    f32 = llamacpp.gguf_files(("F32",))["F32"]
    worker = llamacpp.LlamaCppWorker(threads=2)
    try:
        seconds, theirs = worker.run(f32, prompts, 8)
        assert seconds > 0 and worker.contexts[f32.name]["n_seq_max"] == 2
        ours = engine_tokens(LLMEngine.from_path(str(folder), num_blocks=64), prompts, 8)
        assert theirs == ours
        with pytest.raises(RuntimeError, match="could not load"):
            worker.run(folder / "absent.gguf", prompts, 2)
        assert worker.run(f32, prompts[:1], 2)[1] == [ours[0][:2]]  # still serving
        worker.proc.kill()
        worker.proc.wait()
        with pytest.raises(RuntimeError, match="worker exited"):
            worker.run(f32, prompts, 2)
    finally:
        worker.close()
