"""bench/engine.py's per-batch row: the ratios to transformers and to each alternate side run."""

from __future__ import annotations

import pytest

from bench.engine import LONG, MAX_PAIR_ATTEMPTS, SHORT, batch_row, step_seconds


def test_a_row_carries_the_ratio_and_each_alternate_that_ran():
    rates = {"engine": 2000.0, "transformers": 800.0, "engine_onednn": 1600.0}
    row, line = batch_row(8, rates, {"total": 1.0})
    assert row["ratio"] == 2.5 and row["engine_us_per_decode_step"] == {"total": 1.0}
    assert row["engine_onednn_tok_s"] == 1600.0 and row["kernel_vs_onednn"] == 1.25
    assert "packed_vs_unpacked" not in row and "unpacked" not in line
    assert line.startswith("batch   8: engine") and "kernel GEMM x1.25" in line


def test_weight_dtype_rows_and_their_targets(tiny_model_path, monkeypatch):
    """The batch-1 rows per weight dtype on the tiny model (one repeat of 16 and 4 tokens, a small
    probe): bytes a token reads shrink with the dtype, every row has its GB/s and share of the
    probe, and each target has a boolean. Speeds are not asserted, and a loaded machine's pairs
    with no step time run again (`step_seconds`) as often as it takes here."""
    from bench import engine
    from bench.engine import weight_dtype_rows, weight_dtype_targets
    from common.model.linear import kernel_gemm_available

    monkeypatch.setattr(engine, "LONG", 16)
    monkeypatch.setattr(engine, "SHORT", 4)
    monkeypatch.setattr(engine, "MAX_PAIR_ATTEMPTS", 50)

    rows, lines = weight_dtype_rows(
        str(tiny_model_path), ["float32", "int8"], 1, 8 << 20, stages=True
    )
    assert rows["read_probe_gbps"] > 0 and len(lines) == 3
    for name in ("float32", "int8"):  # each dtype beside its stages' engine (`stages=True`)
        assert {"stages_tok_s", "fused_over_stages"} <= set(rows[name])
    assert "int8_stages" not in rows  # a side of its dtype's row, not a row of its own
    for name in ("float32", "int8"):
        assert {"tok_s", "weight_mb_per_token", "gbps", "over_read_probe", "over_float32"} <= set(
            rows[name]
        )
    if kernel_gemm_available("int8"):
        assert rows["int8"]["packed_as"] == ["int8"]
        share = rows["int8"]["weight_mb_per_token"] / rows["float32"]["weight_mb_per_token"]
        assert 0.25 <= share <= 0.27
    targets, met = weight_dtype_targets(rows)
    assert set(targets) == set(met) == {
        "float32_over_read_probe", "int8_over_read_probe", "int8_over_float32"
    }  # fmt: skip
    assert all(isinstance(v, bool) for v in met.values())


def test_a_pair_with_no_step_time_runs_again() -> None:
    """A busy spell over the short run made the long run look shorter: that pair is no figure
    (the run that printed -75346 tok/s), the next one is."""
    seconds = iter([1.0, 1.5, 2.0, 0.5])  # long, short: a negative pair, then a real one
    calls = []

    def run(prompts, tokens):
        calls.append(tokens)
        return next(seconds)

    assert step_seconds("engine", run, [[1]]) == pytest.approx(1.5 / (LONG - SHORT))
    assert calls == [LONG, SHORT, LONG, SHORT]


def test_a_machine_too_busy_to_time_is_an_error_not_a_figure() -> None:
    with pytest.raises(RuntimeError, match="too busy to time"):
        step_seconds("engine", lambda prompts, tokens: 1.0, [[1]])
    assert MAX_PAIR_ATTEMPTS >= 2
