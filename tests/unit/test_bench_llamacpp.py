"""bench/llamacpp.py's parts that need no llama.cpp: when the side is skipped, the rows and
targets at equal bits per weight, what a GGUF file is reported as, greedy agreement. The side
itself, with llama.cpp, is tests/integration/test_llamacpp_side.py (skipped without its env)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench import llamacpp


def test_the_side_says_why_it_is_skipped(tiny_model_path: Path, monkeypatch, tmp_path) -> None:
    assert "smollm2" in (llamacpp.skip_reason(str(tiny_model_path)) or "")
    smollm2 = llamacpp.cache_root() / "models" / f"smollm2-float32-v{llamacpp.FORMAT_VERSION}"
    monkeypatch.setattr(llamacpp, "VENV", tmp_path / "absent")
    assert "llamacpp_env.sh" in (llamacpp.skip_reason(str(smollm2)) or "")


def test_rows_and_targets_at_equal_bits_per_weight() -> None:
    rates = {"engine": 90.0, "engine_kv16": 100.0, "engine_bfloat16": 150.0,
             "engine_bfloat16_medium": 170.0, "llamacpp_F32": 60.0, "llamacpp_BF16": 160.0,
             "llamacpp_Q4_1": 200.0, "transformers": 30.0}  # fmt: skip
    row, line = llamacpp.batch_row(1, rates)
    assert row["engine_over_F32"] == 1.5 and row["engine_bfloat16_over_BF16"] == 0.94
    assert row["engine_bfloat16_medium_over_BF16"] == 1.06
    assert row["engine_kv16_over_F32"] == 1.67 and "float32 with 16-bit KV x1.67 F32" in line
    assert row["Q4_1_tok_s"] == 200.0 and not any("Q4_1" in k and "over" in k for k in row)
    assert "float32 x1.50 F32" in line and "bfloat16 x0.94 BF16" in line
    assert "bfloat16 medium x1.06 BF16" in line
    rates32 = {k: v * 10 for k, v in rates.items()} | {"engine": 1300.0}
    rates32 |= {"engine_bfloat16_medium": 3300.0}
    wanted, met = llamacpp.targets(
        {"1": row, "8": llamacpp.batch_row(8, rates)[0], "32": llamacpp.batch_row(32, rates32)[0]}
    )
    assert wanted == {
        "over_llamacpp_f32_batch_1": ">= 1.0", "over_llamacpp_bf16_batch_1": ">= 1.0",
        "over_llamacpp_bf16_medium_batch_1": ">= 1.0", "over_llamacpp_f32_kv16_batch_1": ">= 1.0",
        "over_llamacpp_f32_batch_32": ">= 2.0", "over_llamacpp_bf16_batch_32": ">= 2.0",
        "over_llamacpp_bf16_medium_batch_32": ">= 2.0",
        "over_llamacpp_f32_kv16_batch_32": ">= 2.0",
    }  # fmt: skip
    assert met == {
        "over_llamacpp_f32_batch_1": True, "over_llamacpp_bf16_batch_1": False,
        "over_llamacpp_bf16_medium_batch_1": True, "over_llamacpp_f32_kv16_batch_1": True,
        "over_llamacpp_f32_batch_32": True, "over_llamacpp_bf16_batch_32": False,
        "over_llamacpp_bf16_medium_batch_32": True, "over_llamacpp_f32_kv16_batch_32": False,
    }  # fmt: skip
    assert set(llamacpp.unjudged([1, 32])[0]) == set(wanted)


def test_a_gguf_is_reported_as_what_it_holds(tmp_path: Path) -> None:
    """Bits per weight count every stored byte: a bfloat16 matrix beside a float32 norm."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    path = tmp_path / "m.gguf"
    writer = GGUFWriter(str(path), "llama")
    matrix = np.ones((64, 32), dtype=np.float32)
    writer.add_tensor("blk.0.attn_q.weight", quantize(matrix, GGMLQuantizationType.BF16),
                      raw_dtype=GGMLQuantizationType.BF16)  # fmt: skip
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(32, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    info = llamacpp.describe_gguf(path)
    assert info["tensor_types"] == {"BF16": 1, "F32": 1}
    assert info["bits_per_weight_2d"] == 16.0
    assert info["bits_per_weight"] == round(8 * (64 * 32 * 2 + 32 * 4) / (64 * 32 + 32), 2)


def test_greedy_agreement_counts_leading_shared_tokens() -> None:
    assert llamacpp.greedy_agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 9], [7, 5, 6]]) == [2, 0]
