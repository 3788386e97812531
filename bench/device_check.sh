#!/usr/bin/env bash
# Issue 53's GPU checks, from a bare GPU machine (no Ray, no package registry), in under 8 minutes:
# installs the wheels carried in .whl/ (`make device-wheels` fills it, DEVICE_UCX=1 with the
# shards' UCX), builds the C++ attention kernel the host shards use (the image has nanobind and
# CMake; without it they run the torch reference), prepares the random presets, runs tests/gpu
# and `bench/engine.py --device cuda`, and writes their results as JSON to $OUT (6 files, within
# what the device tool brings back), beside the logs:
#   gpu_tests.json   pytest's outcome per test (junit XML read back), and the counts
#   engine_cuda.json bench/engine.py's last line (engine vs transformers tok/s, batch 1-128)
#   device_check.json the summary, also printed as the last line
#   bash bench/device_check.sh          (from the repo root; OUT defaults to results/device)
set -uo pipefail
OUT=${OUT:-results/device}
mkdir -p "$OUT"
SITE=/tmp/phasemesh-site
START=$(date +%s)
log() { echo "[device_check +$(($(date +%s) - START))s] $*"; }
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

log "GPU: $(nvidia-smi -L 2>/dev/null | head -1)"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl || { log "wheel install failed"; exit 1; }
else
    log "no wheels in .whl/: run make device-wheels where pip reaches a registry"; exit 1
fi
export PYTHONPATH="$PWD:$SITE"
log "building the attention kernel (csrc/), beside the presets"
(CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) timeout 240 python3 -m pip install -q --no-build-isolation \
    --no-deps --no-cache-dir --target "$SITE" ./csrc >"$OUT/kernel_build.log" 2>&1 \
    && touch /tmp/phasemesh-kernel-built) &
KERNEL_BUILD=$!
timeout 120 python3 -m common.model.default --preset tiny --preset small || { log "presets failed"; exit 1; }
wait "$KERNEL_BUILD"
[ -f /tmp/phasemesh-kernel-built ] && log "kernel built" || log "kernel not built (shards use the torch reference)"

log "tests/gpu"
timeout 300 python3 -m pytest -q -p no:randomly -p no:cacheprovider tests/gpu \
    --junitxml=/tmp/phasemesh-gpu-tests.xml --durations=10 2>&1 | tee "$OUT/gpu_tests.log"
python3 - "$OUT" <<'PY'
import json, sys, xml.etree.ElementTree as ET
out = sys.argv[1]
try:
    root = ET.parse("/tmp/phasemesh-gpu-tests.xml").getroot()
except (OSError, ET.ParseError) as exc:
    json.dump({"error": f"no junit XML: {exc}"}, open(f"{out}/gpu_tests.json", "w")); sys.exit()
cases = {}
for case in root.iter("testcase"):
    outcome = "passed"
    for tag in ("failure", "error", "skipped"):
        node = case.find(tag)
        if node is not None:
            outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
            cases[f"{case.get('name')}"] = {"outcome": outcome, "time_s": float(case.get("time", 0)),
                                            "message": (node.get("message") or "")[:300]}
            break
    else:
        cases[f"{case.get('name')}"] = {"outcome": outcome, "time_s": float(case.get("time", 0))}
counts = {k: sum(c["outcome"] == k for c in cases.values()) for k in ("passed", "failed", "error", "skipped")}
json.dump({"counts": counts, "tests": cases}, open(f"{out}/gpu_tests.json", "w"), indent=1)
PY

log "bench/engine.py --device cuda"
timeout 240 python3 bench/engine.py --device cuda --model small --batches 1 8 32 128 \
    --repeats 3 2>&1 | tee "$OUT/engine_cuda.log"
tail -n 1 "$OUT/engine_cuda.log" | python3 -c 'import json,sys; json.loads(sys.stdin.read())' \
    && tail -n 1 "$OUT/engine_cuda.log" >"$OUT/engine_cuda.json" \
    || echo '{"error": "bench/engine.py printed no JSON"}' >"$OUT/engine_cuda.json"

python3 - "$OUT" "$(($(date +%s) - START))" <<'PY'
import json, sys
out, seconds = sys.argv[1], int(sys.argv[2])
tests, bench = (json.load(open(f"{out}/{name}.json")) for name in ("gpu_tests", "engine_cuda"))
counts = tests.get("counts", {})
summary = {
    "seconds": seconds, "tests": counts, "engine_cuda": bench.get("batches"),
    "targets": {"gpu_tests": "all passed, none failed", "seconds": "< 480",
                **bench.get("targets", {})},
    "targets_met": {"gpu_tests": counts.get("passed", 0) > 0 and not counts.get("failed")
                    and not counts.get("error"), "seconds": seconds < 480,
                    **bench.get("targets_met", {})},
}
json.dump(summary, open(f"{out}/device_check.json", "w"))
print(json.dumps(summary))
PY
