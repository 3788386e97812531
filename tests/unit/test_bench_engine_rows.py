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
        str(tiny_model_path), ["float32", "int8"], 1, 8 << 20, stages=True, scheduler_steps=4
    )
    assert rows["read_probe_gbps"] > 0 and len(lines) == 3 and rows["scheduler_steps"] == 4
    for name in ("float32", "int8"):  # each dtype beside its stages' and its single steps' engines
        assert {"stages_tok_s", "fused_over_stages"} <= set(rows[name])
        assert {"single_step_tok_s", "steps_over_single"} <= set(rows[name])
    assert "int8_stages" not in rows and "int8_single_step" not in rows  # sides, not rows
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


def test_the_weight_dtype_engines_decode_several_steps_a_call_beside_one(tiny_model_path):
    """`--scheduler-steps`: each dtype's engine takes that many greedy iterations a call, its
    single-step side one, its stages' side one (the steps need the fused layers)."""
    from bench.engine import weight_dtype_engines

    sides = weight_dtype_engines(str(tiny_model_path), ["int8"], True, scheduler_steps=4)
    steps = {name: e.config.scheduler.num_scheduler_steps for name, e in sides.items()}
    assert steps == {"int8": 4, "int8_single_step": 1, "int8_stages": 1}
    assert not sides["int8_stages"].runner.fuse_decode and sides["int8"].runner.fuse_decode
    assert set(weight_dtype_engines(str(tiny_model_path), ["int8"], False)) == {"int8"}


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


def test_every_side_generates_once_untimed_before_its_repeats() -> None:
    """`decode_tokens_per_s`: each side's first call is one untimed SHORT generation (a side's
    first run builds what it builds once, at about half its later rate), then the sides
    alternate LONG, SHORT pairs repeat by repeat; the first call's time is in no figure."""
    from bench.engine import decode_tokens_per_s

    calls: list[tuple[str, int]] = []

    def side(name: str, first_s: float):  # type: ignore[no-untyped-def]
        def run(prompts, tokens):  # type: ignore[no-untyped-def]
            calls.append((name, tokens))
            if len([c for c in calls if c[0] == name]) == 1:
                return first_s
            return tokens * 0.01

        return run

    rates = decode_tokens_per_s({"a": side("a", 99.0), "b": side("b", 0.0)}, [[1], [2]], 2)
    assert calls[:2] == [("a", SHORT), ("b", SHORT)]
    assert calls[2:6] == [("a", LONG), ("a", SHORT), ("b", LONG), ("b", SHORT)]
    assert len(calls) == 2 + 2 * 2 * 2
    assert rates == {"a": pytest.approx(2 / 0.01), "b": pytest.approx(2 / 0.01)}


def test_the_medium_side_runs_at_its_matmul_precision() -> None:
    """`side_call`: the bfloat16-products side runs every call at matmul precision "medium",
    restored after; any other side at the process's own."""
    from bench.engine import side_call
    from common.model.linear import get_matmul_precision

    seen = []

    def fn(engine, prompts, tokens):  # type: ignore[no-untyped-def]
        seen.append((engine, get_matmul_precision()))
        return 1.0

    side_call("engine_bfloat16_medium", "e1", fn)([[1]], SHORT)
    side_call("engine_bfloat16", "e2", fn)([[1]], SHORT)
    assert seen == [("e1", "medium"), ("e2", "highest")]
    assert get_matmul_precision() == "highest"
