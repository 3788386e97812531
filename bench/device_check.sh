#!/usr/bin/env bash
# Issue 53's GPU checks, from a bare GPU machine (no Ray, no package registry), in under 8 minutes:
# installs the wheels carried in .whl/ (`make device-wheels` fills it, DEVICE_UCX=1 with the
# shards' UCX), builds the C++ attention kernel the host shards use (the image has nanobind and
# CMake; without it they run the torch reference), prepares the random presets, runs tests/gpu,
# `bench/engine.py --device cuda`, `bench/device_profile.py --device cuda` and
# `bench/neo.py --device cuda`, then the simulator's Lamina and Neo directions on the measured
# profile beside the Splitwise ones, and writes their results as JSON to $OUT (8 files, what the
# device tool brings back):
#   gpu_tests.json     pytest's outcome per test (junit XML read back), and the counts
#   engine_cuda.json   bench/engine.py's last line (engine vs transformers tok/s, batch 1-128)
#   device_profile.json the device's costs in the simulator's format (loadgen/sim/device_profile.py)
#   neo_cuda.json      bench/neo.py's last line (offload vs GPU-only KV at one GPU budget)
#   device_check.json  the summary, with `python -m loadgen.sim devices`'s, also the last line
#   gpu_tests.log, benches.log, kernel_build.log
# Each step's timeout is cut to what is left of DEADLINE_S (470 s) from the start; a step with
# less than a minute left is skipped and says so in its JSON.
#   bash bench/device_check.sh          (from the repo root; OUT defaults to results/device)
set -uo pipefail
OUT=${OUT:-results/device}
mkdir -p "$OUT"
SITE=/tmp/phasemesh-site
START=$(date +%s)
DEADLINE_S=${DEADLINE_S:-470}
log() { echo "[device_check +$(($(date +%s) - START))s] $*"; }
# min(cap, what is left before the deadline less 10 s of reporting); 0 when under a minute is left.
budget() {
    local left=$((DEADLINE_S - 10 - ($(date +%s) - START)))
    if [ "$left" -lt 60 ]; then echo 0; elif [ "$left" -lt "$1" ]; then echo "$left"; else echo "$1"; fi
}
# last_json NAME CAP COMMAND...: run it within its budget, its output appended to benches.log, its
# last line (one JSON object) to $OUT/NAME.json, or an error object saying why not.
last_json() {
    local name=$1 cap; cap=$(budget "$2"); shift 2
    if [ "$cap" -eq 0 ]; then
        log "$name skipped: the deadline is near"
        echo "{\"error\": \"skipped: under a minute left of ${DEADLINE_S} s\"}" >"$OUT/$name.json"
        return
    fi
    log "$name (at most ${cap} s): $*"
    echo "== $name: $*" >>"$OUT/benches.log"
    timeout "$cap" "$@" 2>&1 | tee -a "$OUT/benches.log" | tail -n 1 >"/tmp/phasemesh-$name.last"
    python3 -c 'import json,sys; json.loads(open(sys.argv[1]).read())' "/tmp/phasemesh-$name.last" 2>/dev/null \
        && cp "/tmp/phasemesh-$name.last" "$OUT/$name.json" \
        || echo "{\"error\": \"$name printed no JSON (see benches.log)\"}" >"$OUT/$name.json"
}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

log "GPU: $(nvidia-smi -L 2>/dev/null | head -1)"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl || { log "wheel install failed"; exit 1; }
else
    log "no wheels in .whl/: run make device-wheels where pip reaches a registry"; exit 1
fi
export PYTHONPATH="$PWD:$SITE"
if [ -d .whl/shared ]; then  # the trace and profiles `make device-wheels` carried (no ../shared)
    export PHASEMESH_SHARED="$PWD/.whl/shared"
    export PHASEMESH_PERF_PROFILE="$PWD/.whl/shared/perf/splitwise_perf_model.csv"
fi
log "building the attention kernel (csrc/), beside the presets"
(CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) timeout 240 python3 -m pip install -q --no-build-isolation \
    --no-deps --no-cache-dir --target "$SITE" ./csrc >"$OUT/kernel_build.log" 2>&1 \
    && touch /tmp/phasemesh-kernel-built) &
KERNEL_BUILD=$!
timeout 120 python3 -m common.model.default --preset tiny --preset small || { log "presets failed"; exit 1; }
wait "$KERNEL_BUILD"
[ -f /tmp/phasemesh-kernel-built ] && log "kernel built" || log "kernel not built (shards use the torch reference)"

log "tests/gpu"
TESTS_S=$(budget 240); [ "$TESTS_S" -gt 0 ] || TESTS_S=1  # (timeout 0 would be none)
timeout "$TESTS_S" python3 -m pytest -q -p no:randomly -p no:cacheprovider tests/gpu \
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

last_json engine_cuda 240 python3 bench/engine.py --device cuda --model small \
    --batches 1 8 32 128 --repeats 3
last_json profile_bench 60 python3 bench/device_profile.py --device cuda --model small \
    --out "$OUT/device_profile.json"
last_json neo_cuda 150 python3 bench/neo.py --device cuda --model small --requests 32 \
    --rates 4,16,64 --max-output 64
last_json sim_devices 30 python3 -m loadgen.sim devices --profiles A100x2 H100x2 \
    "$OUT/device_profile.json"
# These two go into the summary (8 files at most come back).
mv "$OUT/sim_devices.json" /tmp/phasemesh-sim_devices.json
mv "$OUT/profile_bench.json" /tmp/phasemesh-profile_bench.json

python3 - "$OUT" "$(($(date +%s) - START))" "$DEADLINE_S" <<'PY'
import json, sys
out, seconds, deadline = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
tests = json.load(open(f"{out}/gpu_tests.json"))
benches = {name: json.load(open(f"{out}/{name}.json")) for name in ("engine_cuda", "neo_cuda")}
benches["device_profile"] = json.load(open("/tmp/phasemesh-profile_bench.json"))
sim = json.load(open("/tmp/phasemesh-sim_devices.json"))
counts = tests.get("counts", {})
targets = {"gpu_tests": "all passed, none failed", "seconds": f"< {deadline + 10}"}
met = {"gpu_tests": counts.get("passed", 0) > 0 and not counts.get("failed")
       and not counts.get("error"), "seconds": seconds < deadline + 10}
for name, result in [*benches.items(), ("sim_devices", sim)]:
    for key, target in result.get("targets", {}).items():
        targets[f"{name}:{key}"] = target
        met[f"{name}:{key}"] = result.get("targets_met", {}).get(key)
    if "error" in result:
        targets[name], met[name] = "ran", False
neo = benches["neo_cuda"]
summary = {
    "seconds": seconds, "tests": counts, "engine_cuda": benches["engine_cuda"].get("batches"),
    "neo_cuda": {k: neo.get(k) for k in ("sustainable", "decode_batch_offload_over_local",
                                         "tokens_s_offload_over_local", "best_rate_local_only",
                                         "best_rate_offload", "step_time_median_error")},
    "sim_devices": sim.get("profiles"), "errors": {n: r["error"] for n, r in
                                                   [*benches.items(), ("sim_devices", sim)]
                                                   if "error" in r},
    "targets": targets, "targets_met": met,
}
json.dump(summary, open(f"{out}/device_check.json", "w"))
print(json.dumps(summary))
PY
