"""`bench/disagg.py`'s judgement: a tiny run whose local TBT gaps all round to 0.0 ms has no
ratio to them (None), not a ZeroDivisionError that loses the run's figures."""

from __future__ import annotations

from bench import disagg


def row(tbt_p50_ms: float) -> dict:
    return {"tbt_p50_ms": tbt_p50_ms, "tbt_p90_ms": 3.0, "throughput_tok_s": 100.0,
            "breakdown": {}}  # fmt: skip


def test_a_zero_local_tbt_gives_no_ratio_and_no_verdict() -> None:
    figures = {"local": {"2": row(0.0), "8": row(1.0)}, "2_shards": {"2": row(2.0), "8": row(1.5)},
               "2_shards_overlap": {"2": row(2.0), "8": row(1.05)}}  # fmt: skip
    judged = disagg.judge(figures, [2, 8])
    assert judged["tbt_ratio_shards_local"]["2_shards"] == {"2": None, "8": 1.5}
    assert judged["tbt_ratio_shards_local"]["2_shards_overlap"] == {"2": None, "8": 1.05}
    assert judged["targets_met"]["overlap_ratio_b8"] is True  # 1.05 <= 1.10
    assert judged["targets_met"]["overlap_ratio_b32"] is None  # not measured


def test_a_zero_ratio_base_at_a_judged_batch_leaves_that_verdict_open() -> None:
    figures = {"local": {"8": row(0.0)}, "2_shards_overlap": {"8": row(1.0)}}
    assert disagg.judge(figures, [8])["targets_met"]["overlap_ratio_b8"] is None
