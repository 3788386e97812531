"""`tests/e2e/serve_process.on_preset`, which the e2e tests and the serve benches (`--preset`) use
to serve deploy/local.yaml on another model: a random preset's 2 KV heads get 2 shards, while the
real default model keeps the file's shard group, sized for its 3 KV heads."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

from tests.e2e.serve_process import PRESET_SHARDS, on_preset

MESH_FILE = Path(__file__).resolve().parents[2] / "deploy" / "local.yaml"


def shards(config: dict) -> tuple[int, list[int]]:
    [app] = config["applications"]
    replicas = [d.get("num_replicas") for d in app["deployments"] if d["name"] == "AttentionShard"]
    return app["args"]["mesh"]["shards_per_group"], replicas


def test_a_random_preset_gets_its_shards_and_the_real_model_keeps_the_files() -> None:
    config = yaml.safe_load(MESH_FILE.read_text())
    own = shards(config)
    assert own[0] != PRESET_SHARDS  # else this test could not tell the two apart
    tiny = on_preset(copy.deepcopy(config), "tiny")
    assert shards(tiny) == (PRESET_SHARDS, [PRESET_SHARDS])
    real = on_preset(copy.deepcopy(config), "smollm2")
    assert shards(real) == own
    for served, name in ((tiny, "tiny"), (real, "smollm2")):
        args = served["applications"][0]["args"]
        assert args["model"] == args["served_model_name"] == name
