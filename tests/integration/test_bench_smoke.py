"""Each bench of docs/benchmarks/ runs at tiny sizes, as a user runs it, and its last line is
one JSON object with figures, `targets` and a `targets_met` map: so that none rots unnoticed.
Speed is never asserted.

A bench's `main()` runs in this test process with its command line in `sys.argv`
(tests/bench_runs.py's `run_bench`), but those in `OWN_PROCESS`.

Run elsewhere: `bench/serve.py` (tests/integration/test_serve_bench_inprocess.py, and its
served paths in tests/e2e/test_bench_served.py), `bench/profile.py`
(tests/integration/test_profile_bench.py); the benches that measure a served mesh on the e2e
package's one `serve run`: `bench/sim_validation.py` (tests/e2e/local_serve/
test_bench_smoke_served.py), `bench/idle_cost.py` (tests/e2e/local_serve/test_idle_cost.py).
`bench/chaos.py`'s stops and trace need a `serve run` of their own and minutes: here its faults
run, one of them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench import llamacpp
from bench.loadgen_aiperf import find_aiperf
from tests.bench_runs import REPO, assert_figures_and_targets, last_json, run_bench
from tests.sse_stub_server import running_stub

pytestmark = pytest.mark.timeout(300)  # a hang guard: each run takes seconds

SMOKE_RUNS = {
    "early_q": ["bench/early_q.py", "--model", "tiny", "--rows", "1", "--repeats", "1"],
    # Each case's calls rotate over 16 MiB, not twice the cache: its figures count cache hits.
    "attention": "bench/attention.py --quick --context 256 --repeats 1 --rotation-mib 16".split(),
    "router_hotpath": ["bench/router_hotpath.py", "--batch", "1", "--tokens", "8"],
    # Rate probes of 3 simulated seconds: too short to rank the designs, long enough to run.
    "simulator": ["bench/simulator.py", "--duration", "3"],
    "device_profile": "bench/device_profile.py --device cpu --model tiny --repeats 1".split(),
    # The device check runs it with --device cuda; here the CPU version, two meshes of one rate.
    "neo": "bench/neo.py --device cpu --requests 4 --rates 8 --max-output 8".split(),
    "autoscale": (
        "bench/autoscale.py --rate 4 --duration 120 --step 3x@40s+40s --max-machines 8 "
        "--probe-s 20 --settle-s 60 --startup-s 10 --seeds 0"
    ).split(),
    "engine": (
        "bench/engine.py --model tiny --batches 1 --repeats 1 --weight-dtype-repeats 1 "
        "--no-unpacked --no-onednn"
    ).split(),
    "seesaw": "bench/seesaw.py --requests 4 --rounds 1 --modes seesaw pp --max-len 64".split(),
    "structured": "bench/structured.py --batches 8 --vocabs 2048 --steps 8 --repeats 1".split(),
    "grammar_engines": ["bench/grammar_engines.py", "--vocabs", "2048"],
    "transport": ["bench/transport.py", "--repeats", "1", "--round-trips", "20"],
    # LocalMesh benches, the tiny model.
    "kv_transfer": "bench/kv_transfer.py --model tiny --tokens 128 --rounds 1".split(),
    # n = 2 against n = 1 judged; overlap and the model peer's lanes are the full run's.
    "disagg": (
        "bench/disagg.py --model tiny --batches 2 --tokens 12 --rounds 1 --skip-transport "
        "--columns 2_shards 2_shards_2lanes"
    ).split(),
    "telemetry": "bench/telemetry.py --rounds 1 --batch 2 --tokens 16 --shards 1".split(),
    "admission_stall": (
        "bench/admission_stall.py --residents 2 --newcomers 2 --newcomer-prompt 256 --quiet-s 0.1 "
        "--shards-per-group 1"
    ).split(),
    "prefix": (
        "bench/prefix.py --conversations 2 --span-s 1 --max-tokens 2 --num-blocks 256"
    ).split(),
    "lm_head_fold": (
        "bench/lm_head_fold.py --model tiny --rounds 1 --tokens 4 --weight-dtypes int8"
    ).split(),
    # Three fresh interpreters (a start without the cache, the cold one, a warm one).
    "replica_startup": "bench/replica_startup.py --models tiny --repeats 1 --num-blocks 64".split(),
    # The cheapest fault on its own (--only stops and the trace need `serve run`: minutes).
    "chaos": (
        "bench/chaos.py --only faults --faults prompt_engine_kill --streams 2 --stream-tokens 16"
    ).split(),
}
# Benches that run as a process of their own, and why.
OWN_PROCESS = {
    "telemetry": "it installs the process's tracer provider (once per process)",
    # Nothing to share: no torch, no mesh; its pure-Python event loop ran slower in a test
    # process than in a fresh interpreter.
    "simulator": "it imports nothing a test process has loaded",
}

# Documented benches whose smoke run is elsewhere (the test file that runs it), or none (why).
ELSEWHERE = {
    "serve": "tests/integration/test_serve_bench_inprocess.py",
    "profile": "tests/integration/test_profile_bench.py",
    "sim_validation": "tests/e2e/local_serve/test_bench_smoke_served.py",
    "idle_cost": "tests/e2e/local_serve/test_idle_cost.py",
    "llamacpp": "tests/integration/test_bench_smoke.py",
    "loadgen_aiperf": "tests/integration/test_bench_smoke.py",
}
# Issue 54's benches judge their targets per CPU variant: their JSON names it (bench/machine.py).
NAMES_THE_CPU = {"attention", "engine", "prefix"}
NO_SMOKE_RUN = {
    "attention_ab": "an A/B tool over two kernel source trees: each run compiles both (minutes)",
    "linear_ab": "an A/B tool over two kernel source trees: each run compiles both (minutes)",
}


def test_every_documented_bench_has_a_smoke_run() -> None:
    """A bench added to docs/benchmarks/ (a page, or the index) gets a smoke run here, or says
    where it has one."""
    pages = [REPO / "docs" / "benchmarks.md", *sorted((REPO / "docs" / "benchmarks").glob("*.md"))]
    text = "\n".join(page.read_text() for page in pages)
    documented = set(re.findall(r"bench/(\w+)\.py", text))
    assert len(pages) > 1 and documented, "docs/benchmarks/ names no bench"
    missing = documented - set(SMOKE_RUNS) - set(ELSEWHERE) - set(NO_SMOKE_RUN)
    assert not missing, f"no smoke run for {sorted(missing)}"
    for bench, test_file in ELSEWHERE.items():
        assert f"bench/{bench}.py" in (REPO / test_file).read_text(), (bench, test_file)


@pytest.mark.usefixtures("tiny_model_path")  # written on first use
@pytest.mark.parametrize("bench", sorted(SMOKE_RUNS))
def test_the_bench_prints_figures_and_its_targets(bench: str) -> None:
    command = SMOKE_RUNS[bench]
    result = last_json(command) if bench in OWN_PROCESS else run_bench(command)
    assert_figures_and_targets(result)
    if bench in NAMES_THE_CPU:
        assert {"vendor", "family", "model", "isa"} <= set(result["cpu"]), result.get("cpu")


def test_loadgen_aiperf_prints_its_figures_or_why_it_did_not_run(tiny_model_path: Path) -> None:
    """Against the SSE stub (the bench compares two clients' measuring, not a server): with
    AIPerf installed, figures and verdicts; without it (CI), one JSON line that says why, with
    the targets it would have judged."""
    stub = ("--first-token-delay-s", "0.3", "--token-delay-s", "0.03")
    with running_stub(*stub) as (_, url):
        command = ["bench/loadgen_aiperf.py", "--url", url, "--tokenizer", str(tiny_model_path),
                   "--num-requests", "4", "--rounds", "1"]  # fmt: skip
        result = run_bench(command)
    if find_aiperf() is None:
        assert "aiperf not found" in result["skipped"]
        assert result["targets"] and result["targets_met"] == {}
    else:
        assert_figures_and_targets(result)


@pytest.mark.skipif(
    not (llamacpp.VENV / "bin" / "python").is_file(),
    reason=f"no llama.cpp environment at {llamacpp.VENV} (bench/llamacpp_env.sh)",
)
def test_engine_bench_runs_llamacpps_side() -> None:
    """`bench/engine.py --model smollm2` with llama.cpp's environment: its rows and its targets
    beside PhaseMesh's (bench/llamacpp.py)."""
    folder = llamacpp.cache_root() / "models" / f"smollm2-float32-v{llamacpp.FORMAT_VERSION}"
    if not (folder / "model.safetensors").is_file():
        pytest.skip(f"SmolLM2 is not prepared at {folder} (make model)")
    result = run_bench(["bench/engine.py", "--model", "smollm2", "--batches", "1", "--repeats",
                        "1", "--weight-dtype-repeats", "1", "--no-unpacked",
                        "--no-onednn"])  # fmt: skip
    assert_figures_and_targets(result)
    assert "skipped" not in result["llamacpp"], result["llamacpp"]
    assert result["llamacpp"]["batches"]["1"]
    assert any(name.startswith("over_llamacpp_") for name in result["targets_met"])
