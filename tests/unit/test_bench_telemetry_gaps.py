"""bench/telemetry.py's per-token gaps from a request's outputs, when tokens arrive together."""

from __future__ import annotations

import pytest

from bench import telemetry
from bench.telemetry import MIN_TOKENS, token_gaps


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


def test_a_request_of_min_tokens_has_a_gap_and_fewer_are_refused_at_the_command_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """One token per output: `MIN_TOKENS` give one gap, one fewer none; the bench refuses such a
    `--tokens` before starting a mesh, rather than failing on an empty median rounds later."""
    assert len(token_gaps([(float(i), 1) for i in range(MIN_TOKENS)])) == 1
    assert token_gaps([(float(i), 1) for i in range(MIN_TOKENS - 1)]) == []
    for argv in (["--tokens", str(MIN_TOKENS - 1)], ["--rounds", "0"], ["--batch", "-1"]):
        monkeypatch.setattr("sys.argv", ["bench/telemetry.py", *argv])
        with pytest.raises(SystemExit) as exit_info:
            telemetry.main()
        assert exit_info.value.code == 2
        assert "must be at least" in capsys.readouterr().err
