"""loadgen and AIPerf measure the same latencies on the same slice (`bench/loadgen_aiperf.py`).

Runs only where AIPerf is installed (`$PHASEMESH_AIPERF` or `aiperf` on PATH; it is not one of
the project's dependencies). The server is `tests.sse_stub_server` with a fixed first-token delay
(a prefill's) and token pace, so both tools face the same known latencies: what is compared is
the two clients' measuring, TTFT p50/p90 and E2E p50 within a third.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.loadgen_aiperf import Slice, compare, find_aiperf
from tests.sse_stub_server import running_stub

AIPERF = find_aiperf()
pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(AIPERF is None, reason="aiperf is not installed ($PHASEMESH_AIPERF)"),
]


def test_loadgen_and_aiperf_agree_on_the_same_slice(tmp_path: Path, tiny_model_path: Path) -> None:
    assert AIPERF is not None
    # Latencies well above a shared machine's scheduling noise (tens of ms).
    stub = ("--first-token-delay-s", "0.3", "--token-delay-s", "0.03")
    with running_stub(*stub) as (_, url):
        result = compare(url, str(tiny_model_path), AIPERF, Slice(num_requests=12), tmp_path)
    print(json.dumps(result))  # the bench's figures, for `pytest -rA`
    assert result["loadgen_completed"] == result["aiperf_completed"] == 12
    assert all(result["targets_met"].values()), result
