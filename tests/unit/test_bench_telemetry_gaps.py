"""bench/telemetry.py's per-token gaps from a request's outputs, when tokens arrive together."""

from __future__ import annotations

import pytest

from bench.telemetry import token_gaps


def test_one_token_per_output_gives_the_gaps_after_the_first_three_tokens() -> None:
    arrivals = [(0.0, 1), (1.0, 1), (3.0, 1), (6.0, 1), (10.0, 1)]
    assert token_gaps(arrivals) == [3.0, 4.0]


def test_tokens_that_arrived_together_share_the_wait_before_them() -> None:
    # A loaded machine: 16 tokens in three outputs. Every token after the third has its gap,
    # and none is zero.
    arrivals = [(0.0, 1), (1.0, 5), (3.0, 10)]
    gaps = token_gaps(arrivals)
    assert gaps == pytest.approx([0.2, 0.2, 0.2] + [0.2] * 10)
    assert len(gaps) == 16 - 3
    assert min(gaps) > 0


def test_a_finish_without_tokens_is_not_a_token() -> None:
    assert token_gaps([(0.0, 1), (1.0, 1), (2.0, 1), (4.0, 1), (9.0, 0)]) == [2.0]


def test_the_first_outputs_tokens_have_no_gap() -> None:
    """Nothing came before the first output, so a request whose tokens all came at once (or that
    sent none) has no gaps; the skip counts tokens, wherever outputs split them."""
    assert token_gaps([(5.0, 16)]) == []
    assert token_gaps([]) == []
    assert token_gaps([(0.0, 2), (1.0, 2), (3.0, 1)]) == [0.5, 2.0]  # tokens 3 and 4
    assert token_gaps([(0.0, 1), (1.0, 1), (2.0, 1), (4.0, 1)], skip=0) == [1.0, 1.0, 2.0]
