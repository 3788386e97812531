"""The served OpenAPI schema, fuzzed: schemathesis against `serve run deploy/local.yaml` (the mesh).

Coverage and fuzzing phases, more than a thousand generated requests in all, checked for server
errors, undocumented status codes and responses that do not match the documented schema. The
router's context is capped (`max_model_len: 64`) so that each accepted request generates a few
dozen tokens at most: the run stays within a couple of minutes on two cores. Afterwards the mesh
still serves a normal request, and every engine and shard is back to idle.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.serve_process import REPO, ServeRun

pytestmark = pytest.mark.timeout(600)

MIN_CASES = 1000
SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeRun]:
    run = ServeRun(REPO / "deploy" / "local.yaml", tmp_path_factory.mktemp("serve"),
                   args={"max_model_len": 64})  # fmt: skip
    try:
        run.start()
        yield run
    finally:
        run.stop()


def test_fuzzed_api_has_no_server_errors_and_matches_its_schema(
    server: ServeRun, tmp_path: Path
) -> None:
    command = [
        str(SCHEMATHESIS), "run", f"{server.base_url}/openapi.json",
        "--phases", "coverage,fuzzing",
        "--checks", "not_a_server_error,status_code_conformance,response_schema_conformance",
        "--max-examples", "250", "--seed", "18", "--workers", "2",
        "--request-timeout", "120", "--no-color", "--generation-database", "none",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=540)
    report = result.stdout + result.stderr
    assert result.returncode == 0, report[-8000:]
    generated = re.search(r"(\d+) generated", report)
    assert generated is not None and int(generated.group(1)) >= MIN_CASES, report[-3000:]

    # The mesh still serves, and holds nothing once the fuzzed requests are done.
    response = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                          json={"prompt": "hello", "max_tokens": 4, "temperature": 0})  # fmt: skip
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    deadline = time.monotonic() + 30
    while (stats := httpx.get(f"{server.base_url}/stats", timeout=10).json())["num_requests"] or (
        stats["kv_blocks_used"]
    ):
        assert time.monotonic() < deadline, stats
        time.sleep(0.5)  # frees travel asynchronously: poll another process's state
