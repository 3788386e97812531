"""bench/engine.py's per-batch row: the ratios to transformers and to each alternate side run."""

from __future__ import annotations

from bench.engine import batch_row


def test_a_row_carries_the_ratio_and_each_alternate_that_ran():
    rates = {"engine": 2000.0, "transformers": 800.0, "engine_onednn": 1600.0}
    row, line = batch_row(8, rates, {"total": 1.0})
    assert row["ratio"] == 2.5 and row["engine_us_per_decode_step"] == {"total": 1.0}
    assert row["engine_onednn_tok_s"] == 1600.0 and row["kernel_vs_onednn"] == 1.25
    assert "packed_vs_unpacked" not in row and "unpacked" not in line
    assert line.startswith("batch   8: engine") and "kernel GEMM x1.25" in line
