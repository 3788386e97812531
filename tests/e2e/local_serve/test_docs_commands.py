"""Every command block in README.md and docs/ (its pages at any depth) runs as printed.

Each fenced block carries a marker on the line before it:

- `<!-- runnable -->`: runs on its own;
- `<!-- runnable: served -->`: runs against the served API (`serve run deploy/local.yaml`, started
  once for the package in `conftest.py`, on a free port and the tiny model; `http://127.0.0.1:8000`
  in the block is pointed at it, and the model the docs name, `make run`'s `smollm2`, is the
  served one);
- `<!-- illustration: WHY -->`: not run here: a fragment, an output, or a command that installs,
  serves until stopped or needs other hardware, with the test that covers it in WHY.

Bash blocks run under `bash -e -o pipefail` with the virtual environment's `bin` first on PATH,
Python blocks with this interpreter, both from the repository root. A block passes when it exits 0
and prints no OpenAI error body; a `loadgen replay` block must also complete every request with
the token counts it asked for.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.serve_process import REPO, ServeRun

pytestmark = pytest.mark.timeout(600)

DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
MARKER = re.compile(r"^<!-- (runnable|runnable: served|illustration: .+) -->$")
FENCE = re.compile(r"^```(\w*)\s*$")
PRINTED_URL = "http://127.0.0.1:8000"
PRINTED_MODEL = "smollm2"  # deploy/local.yaml's served_model_name, what the docs' examples send


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    language: str
    marker: str | None
    code: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def blocks(path: Path) -> Iterator[Block]:
    """The fenced blocks of a Markdown file, each with the marker line just above it, if any."""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        if match := FENCE.match(lines[i]):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            above = lines[i - 1].strip() if i else ""
            marker = MARKER.match(above)
            code = "\n".join(lines[i + 1 : end]) + "\n"
            yield Block(path, i + 1, match.group(1), marker.group(1) if marker else None, code)
            i = end
        i += 1


ALL = [block for path in DOCS for block in blocks(path)]
RUNNABLE = [b for b in ALL if b.marker == "runnable"]
SERVED = [b for b in ALL if b.marker == "runnable: served"]


def test_every_block_says_whether_it_runs() -> None:
    unmarked = [b.name for b in ALL if b.marker is None]
    assert not unmarked, f"mark these blocks runnable or illustration: {unmarked}"
    assert all(b.language in ("bash", "python") for b in RUNNABLE + SERVED)
    assert any("loadgen replay" in b.code for b in SERVED if b.path.name == "README.md")


def run_block(block: Block, server: ServeRun | None = None) -> subprocess.CompletedProcess[str]:
    code = block.code
    if server is not None:
        served_name = server.config["applications"][0]["args"]["served_model_name"]
        code = code.replace(PRINTED_URL, server.base_url)
        code = re.sub(rf"\b{PRINTED_MODEL}\b", served_name, code)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    command = [sys.executable, "-c", code] if block.language == "python" else [
        "bash", "-e", "-o", "pipefail", "-c", code]  # fmt: skip
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)


def check(block: Block, result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, f"{block.name}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert '"error"' not in result.stdout, f"{block.name}: {result.stdout[-3000:]}"
    if "loadgen replay" in block.code:
        summary = json.loads(result.stdout.strip().splitlines()[-1])
        assert summary["num_requests"] > 0 and summary["failed"] == 0, summary["error_kinds"]
        assert summary["completed"] == summary["num_requests"]
        assert summary["usage_mismatches"] == {"prompt_tokens": 0, "completion_tokens": 0,
                                               "no_usage": 0}  # fmt: skip


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.name)
def test_runnable_block(block: Block) -> None:
    check(block, run_block(block))


@pytest.mark.parametrize("block", SERVED, ids=lambda b: b.name)
def test_served_block(block: Block, server: ServeRun) -> None:
    check(block, run_block(block, server))
