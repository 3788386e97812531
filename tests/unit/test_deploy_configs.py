"""Every serve config in deploy/ parses with the installed Ray's `ServeDeploySchema`, and says
what PhaseMesh needs: explicit HTTP host, explicit CPU requests, args the builder accepts.

A YAML is a serve config if it has `applications`; a KubeRay RayService is checked through its
embedded `serveConfigV2`. Other YAMLs in deploy/ (Prometheus, OTel collector) are not ours.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import ray
import yaml
from ray.serve import Application
from ray.serve.schema import ServeDeploySchema

from services.app import DEPLOYMENT_NAMES, AppArgs, build_app, deployment_names
from services.mesh.autoscaling import GROUP_DEPLOYMENTS, MeshAppAutoscalingPolicy
from services.mesh.replica import DRAIN_NOTICE_S

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KEY = "ab" * 32  # a mesh key (hex)
EXPECTED = {"local.yaml", "single.yaml", "cluster.yaml", "rayservice.yaml", "gpu.yaml",
            "cluster-gpu.yaml"}  # fmt: skip
CLUSTERS = ["cluster.yaml", "cluster-gpu.yaml"]


def serve_configs() -> dict[str, dict[str, Any]]:
    """name -> serve config dict, for every serve config (plain or embedded) in deploy/."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted([*DEPLOY.glob("*.yaml"), *DEPLOY.glob("*.yml")]):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and "applications" in doc:
                found[path.name] = doc
            elif isinstance(doc, dict) and doc.get("kind") == "RayService":
                found[path.name] = yaml.safe_load(doc["spec"]["serveConfigV2"])
    return found


CONFIGS = serve_configs()


def test_the_expected_configs_exist() -> None:
    assert set(CONFIGS) >= EXPECTED


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_validates_against_ray_schema(name: str) -> None:
    schema = ServeDeploySchema.model_validate(CONFIGS[name])
    assert schema.applications, "a serve config with no application deploys nothing"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_states_what_ray_would_default(name: str) -> None:
    config = CONFIGS[name]
    # NOTE: Ray 2.60's default host is all interfaces; every file must choose.
    assert "host" in config["http_options"]
    for app in config["applications"]:
        assert app["import_path"] == "services.app:build_app"
        args = AppArgs.model_validate(app["args"])  # the builder accepts these args
        for deployment in app["deployments"]:
            # Serve refuses a config naming a deployment the app does not have.
            offline = args.offline is not None
            names = deployment_names(args.topology, args.mesh.model_peers, offline)
            assert deployment["name"] in names
            # A replica takes a whole CPU unless told otherwise.
            assert "num_cpus" in deployment["ray_actor_options"]


def test_local_config_fits_two_cores_on_loopback() -> None:
    config = CONFIGS["local.yaml"]
    assert config["http_options"]["host"] == "127.0.0.1"
    [app] = config["applications"]
    cpus = sum(
        d["ray_actor_options"]["num_cpus"] * d.get("num_replicas", 1) for d in app["deployments"]
    )
    assert cpus <= 1.5  # leaves room on a 2-core machine for the controller, proxy and tests
    assert app["args"]["topology"] == "mesh"
    assert {d["name"] for d in app["deployments"]} == set(DEPLOYMENT_NAMES)


def test_single_config_is_the_router_with_its_in_process_engine() -> None:
    config = CONFIGS["single.yaml"]
    assert config["http_options"]["host"] == "127.0.0.1"
    [app] = config["applications"]
    assert app["args"]["topology"] == "local"
    assert [d["name"] for d in app["deployments"]] == ["Router"]
    assert isinstance(build_app(app["args"]), Application)


@pytest.mark.parametrize("name", CLUSTERS)
def test_cluster_config_places_engines_and_shards_by_custom_resource(name: str) -> None:
    [app] = CONFIGS[name]["applications"]
    by_name = {d["name"]: d for d in app["deployments"]}
    assert set(by_name) == set(DEPLOYMENT_NAMES)
    for name, resource in [
        ("PromptEngine", "compute_node"),
        ("TokenEngine", "compute_node"),
        ("AttentionShard", "memory_node"),
    ]:
        assert resource in by_name[name]["ray_actor_options"]["resources"]
    assert all("autoscaling_config" in d for d in by_name.values())


@pytest.mark.parametrize("name", CLUSTERS)
def test_cluster_engines_and_shards_scale_on_their_own_load(name: str) -> None:
    [app] = CONFIGS[name]["applications"]
    policy = app["autoscaling_policy"]
    assert policy["policy_function"] == "services.mesh.autoscaling:MeshAppAutoscalingPolicy"
    built = MeshAppAutoscalingPolicy(**policy["policy_kwargs"])  # raises on bad kwargs
    assert built.group is not None and set(built.roles) == {"PromptEngine"}
    by_name = {d["name"]: d for d in app["deployments"]}
    for name in ("PromptEngine", *GROUP_DEPLOYMENTS):
        scaling = by_name[name]["autoscaling_config"]
        # Serve's own delays would stack on the policy's: they are off; and the application's
        # policy is the one (a deployment's own would be ignored).
        assert scaling["upscale_delay_s"] == scaling["downscale_delay_s"] == 0
        assert "policy" not in scaling
    # A token engine and its group as one unit: the shards' bounds are the engines' x the group.
    group = built.group.shards_per_group
    assert group == app["args"]["mesh"]["shards_per_group"]
    engines, shards = (by_name[n]["autoscaling_config"] for n in GROUP_DEPLOYMENTS)
    for bound in ("min_replicas", "initial_replicas", "max_replicas"):
        assert shards[bound] == engines[bound] * group, bound


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_mesh_replicas_get_their_drain_before_serve_kills_them(name: str) -> None:
    """A scaled-down engine serves on `DRAIN_NOTICE_S`, then drains for up to `mesh.drain_s`
    (`MeshReplica.shutdown`); Serve kills it at `graceful_shutdown_timeout_s`."""
    for app in CONFIGS[name]["applications"]:
        drain_s = AppArgs.model_validate(app["args"]).mesh.drain_s
        for d in app.get("deployments", []):
            # A shard serves its draining token engine on, as long (`MeshReplica.shutdown`).
            if d["name"] in ("PromptEngine", "TokenEngine", "AttentionShard"):
                assert d["graceful_shutdown_timeout_s"] > DRAIN_NOTICE_S + drain_s, d["name"]


def test_gpu_config_puts_engines_on_the_gpu_and_shards_on_the_host() -> None:
    """deploy/gpu.yaml: engines ask for the GPU share `mesh.engine_num_gpus` says (the builder
    binds it too, the config's options replacing it), shards for none."""
    [app] = CONFIGS["gpu.yaml"]["applications"]
    args = AppArgs.model_validate(app["args"])
    assert args.mesh.device.startswith("cuda") and 0 < args.mesh.engine_gpus <= 1
    gpus = {d["name"]: d["ray_actor_options"].get("num_gpus", 0) for d in app["deployments"]}
    assert gpus == {"Router": 0, "PromptEngine": args.mesh.engine_gpus,
                    "TokenEngine": args.mesh.engine_gpus, "AttentionShard": 0}  # fmt: skip
    router = build_app(app["args"])._bound_deployment
    bound = {a._bound_deployment.name: a._bound_deployment.ray_actor_options.get("num_gpus", 0)
             for a in router.init_args[1:]}  # fmt: skip
    assert bound == {"PromptEngine": 0.5, "TokenEngine": 0.5, "AttentionShard": 0}
    cpu_only = build_app(CONFIGS["local.yaml"]["applications"][0]["args"])._bound_deployment
    assert all("num_gpus" not in a._bound_deployment.ray_actor_options
               for a in cpu_only.init_args[1:])  # fmt: skip


def test_gpu_cluster_is_the_cluster_config_with_engines_on_whole_gpus() -> None:
    """deploy/cluster-gpu.yaml: cluster.yaml's mesh, policy and placement, with each engine
    replica on a whole GPU (asked as the builder binds it) and the shards on CPU memory nodes."""
    [cpu], [gpu] = (
        CONFIGS["cluster.yaml"]["applications"],
        CONFIGS["cluster-gpu.yaml"]["applications"],
    )
    args = AppArgs.model_validate(gpu["args"])
    assert args.mesh.device == "cuda" and args.mesh.engine_gpus == 1
    gpu_only = {"device", "engine_num_gpus", "num_blocks"}  # the GPU's own KV room
    same = {k: v for k, v in gpu["args"]["mesh"].items() if k not in gpu_only}
    assert same == {k: v for k, v in cpu["args"]["mesh"].items() if k not in gpu_only}
    assert gpu["autoscaling_policy"] == cpu["autoscaling_policy"]
    options = {d["name"]: d["ray_actor_options"] for d in gpu["deployments"]}
    gpus = {name: o.get("num_gpus", 0) for name, o in options.items()}
    assert gpus == {"Router": 0, "PromptEngine": 1, "TokenEngine": 1, "AttentionShard": 0}
    router = build_app(gpu["args"])._bound_deployment
    bound = {a._bound_deployment.name: a._bound_deployment.ray_actor_options.get("num_gpus", 0)
             for a in router.init_args[1:]}  # fmt: skip
    assert bound == {"PromptEngine": 1, "TokenEngine": 1, "AttentionShard": 0}
    # The shards' kernel threads are what their replicas ask for, OpenMP's included.
    shard = options["AttentionShard"]
    assert shard["num_cpus"] == args.mesh.num_threads
    assert shard["runtime_env"]["env_vars"]["OMP_NUM_THREADS"] == str(args.mesh.num_threads)


def test_rayservice_embeds_the_cluster_config() -> None:
    assert CONFIGS["rayservice.yaml"] == CONFIGS["cluster.yaml"]
    [service] = yaml.safe_load_all((DEPLOY / "rayservice.yaml").read_text())
    cluster = service["spec"]["rayClusterConfig"]
    groups = {g["groupName"]: g["rayStartParams"]["resources"] for g in cluster["workerGroupSpecs"]}
    # KubeRay's quoting: a JSON object inside a quoted string.
    assert {k: yaml.safe_load(yaml.safe_load(v)) for k, v in groups.items()} == {
        "compute": {"compute_node": 1},
        "memory": {"memory_node": 1},
    }
    assert cluster["rayVersion"] == ray.__version__  # the Ray the schema test ran against


def test_builder_binds_both_topologies_and_refuses_unknown_args() -> None:
    [local] = CONFIGS["local.yaml"]["applications"]
    for args in (local["args"], local["args"] | {"topology": "local"}):
        assert isinstance(build_app(args), Application)
    assert isinstance(build_app(CONFIGS["cluster.yaml"]["applications"][0]["args"]), Application)
    with pytest.raises(ValueError):
        build_app(local["args"] | {"no_such_arg": 1})


# The mesh switches a deploy chooses (Lamina, Neo): every mesh config states each one.
MESH_SWITCHES = ("kv_transfer", "shard_partition", "attention_overlap", "decode_lanes",
                 "local_kv_blocks", "model_peers")  # fmt: skip


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_mesh_configs_state_every_mesh_switch(name: str) -> None:
    for app in CONFIGS[name]["applications"]:
        if app["args"].get("topology") == "mesh":
            assert set(MESH_SWITCHES) <= set(app["args"]["mesh"])


def test_mesh_switches_reach_the_workers_config() -> None:
    """The `mesh:` args are the options every worker's config carries, whole and as given, on
    the wire too (a worker process decodes its config from JSON); `build_app` binds a dump of
    plain builtins that validates back to the same args."""
    import json

    import msgspec

    from common.worker_config import WorkerConfig
    from services.app import _worker_config

    mesh = dict(host="127.0.0.1", kv_transfer="pull", attention_overlap=True, decode_lanes=3,
                local_kv_blocks=64, tier_policy="alternate:2", kv_hold_bytes=12345,
                kv_over_ucx=False, pools={"lease_s": 2.5})  # fmt: skip
    args = AppArgs.model_validate({"topology": "mesh", "mesh": mesh})
    cfg = _worker_config(args, KEY)
    assert cfg.options == args.mesh and cfg.host == "127.0.0.1" and cfg.mesh_key == KEY
    dumped = msgspec.to_builtins(cfg.options)
    assert {name: dumped[name] for name in mesh} == mesh | {"pools": dumped["pools"]}
    assert dumped["pools"]["lease_s"] == 2.5
    assert msgspec.json.decode(msgspec.json.encode(cfg), type=WorkerConfig) == cfg
    bound = json.loads(json.dumps(args.model_dump()))  # plain builtins
    assert AppArgs.model_validate(bound) == args


@pytest.mark.parametrize(
    "mesh, error",
    [
        ({"shard_partition": "request", "attention_overlap": True}, "without attention_overlap"),
        ({"shard_partition": "request", "decode_lanes": 2}, "with decode_lanes 1"),
        ({"shard_partition": "request", "decode_lanes": "auto"}, "with decode_lanes 1"),
        ({"shard_partition": "request", "local_kv_blocks": 8}, "local_kv_blocks"),
        ({"decode_lanes": 0}, "decode_lanes"),
        ({"decode_lanes": "some"}, "decode_lanes"),
        ({"kv_transfer": "teleport"}, "kv_transfer"),
        ({"shard_partition": "layer"}, "shard_partition"),
        ({"tier_policy": "lru"}, "unknown tier policy"),
        ({"local_kv_blocks": -1}, "local_kv_blocks"),
        ({"model_peers": 1, "shard_partition": "request"}, "head-split shard group"),
        ({"model_peers": 1, "shards_per_group": 0}, "head-split shard group"),
        ({"model_peers": -1}, "model_peers"),
        ({"token_engine_threads": 0}, "token_engine_threads"),
        ({"token_engine_threads": "two"}, "token_engine_threads"),
        ({"progress_timeout_s": 0}, "progress_timeout_s"),
        ({"progress_timeout_s": "soon"}, "progress_timeout_s"),
        ({"shard_rebuild_wait_s": -1}, "shard_rebuild_wait_s"),
        ({"shard_rebuild_wait_s": 30, "progress_timeout_s": 30}, "shard_rebuild_wait_s"),
        ({"pools": {"lease_s": 0}}, "lease_s"),
        ({"no_such_switch": True}, "no_such_switch"),
    ],
)
def test_mesh_args_refuse_what_the_workers_would(mesh: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        AppArgs.model_validate({"topology": "mesh", "mesh": mesh})


@pytest.mark.parametrize("policy", ["", "fill_local", "alternate:3", "neo", "neo:/tmp/t.csv"])
def test_known_tier_policies_are_accepted(policy: str) -> None:
    """Neo's policy is built by its engine (it needs a cost model), but deploys as any other."""
    mesh = {"local_kv_blocks": 8, "tier_policy": policy}
    assert AppArgs.model_validate({"topology": "mesh", "mesh": mesh}).mesh.tier_policy == policy


def test_request_partition_alone_is_accepted() -> None:
    args = AppArgs.model_validate({"topology": "mesh", "mesh": {"shard_partition": "request"}})
    assert args.mesh.decode_lanes == 1 and not args.mesh.attention_overlap


def test_auto_lanes_reach_the_workers_as_auto_starting_at_one() -> None:
    from services.app import _worker_config

    mesh = {"host": "127.0.0.1", "decode_lanes": "auto"}
    args = AppArgs.model_validate({"topology": "mesh", "mesh": mesh})
    options = _worker_config(args, KEY).options
    assert options.decode_lanes == "auto" and options.auto_lanes and options.num_decode_lanes == 1


def bound_names(app: Application) -> list[str]:
    """The deployments an application binds: the Router and the mesh it was bound with."""
    router = app._bound_deployment
    offline = router.init_kwargs.get("offline")
    extra = [offline._bound_deployment.name] if offline is not None else []
    return [router.name] + [a._bound_deployment.name for a in router.init_args[1:]] + extra


def test_model_peers_bind_the_model_peer_deployment_only_when_on() -> None:
    mesh = {"host": "127.0.0.1", "decode_lanes": 3}
    off = build_app({"topology": "mesh", "mesh": mesh})
    assert bound_names(off) == list(DEPLOYMENT_NAMES) == list(deployment_names("mesh"))
    on = build_app({"topology": "mesh", "mesh": mesh | {"model_peers": 1}})
    assert bound_names(on) == [*DEPLOYMENT_NAMES, "ModelPeer"] == list(deployment_names("mesh", 1))


@pytest.mark.parametrize("deployment, role", [("TokenEngineDeployment", "token"),
                         ("ModelPeerDeployment", "model_peer")])  # fmt: skip
def test_model_peers_reach_the_token_engines(
    monkeypatch: pytest.MonkeyPatch, deployment: str, role: str
) -> None:
    """A replica's constructor, with Ray and the worker faked: a token engine is started with
    `model_peers` peers to claim, a model peer as one."""
    from types import SimpleNamespace

    import services.app as app
    import services.mesh.replica as replica  # where the replica imports its start functions from
    from common.roles import Role
    from common.worker_config import role_config

    started: list[tuple[str, tuple[Any, ...]]] = []
    context = SimpleNamespace(app_name="a", deployment=deployment.removesuffix("Deployment"))
    monkeypatch.setattr(app.serve, "get_replica_context", lambda: context)
    registry = SimpleNamespace(agree_key=lambda proposed: "ab" * 32)
    monkeypatch.setattr(app.RayRegistry, "for_app", classmethod(lambda cls, name: registry))
    monkeypatch.setattr(app, "_service_id", lambda role: f"{role}-1")
    monkeypatch.setattr(app, "_configure_observability", lambda *a: None)
    monkeypatch.setattr(replica, "start_engine", lambda *a: started.append(("engine", a)))
    monkeypatch.setattr(replica, "start_model_peer", lambda *a: started.append(("peer", a)))
    mesh = {"host": "127.0.0.1", "model_peers": 2, "token_engine_threads": 3}
    args = {"topology": "mesh", "mesh": mesh}
    replica = getattr(app, deployment).func_or_class(args)
    replica.replica = None  # nothing to shut down
    [(kind, call)] = started
    if role == "token":
        assert kind == "engine" and call[0] == "token" and call[1] == "token-1"
        base = call[3]
    else:
        assert kind == "peer" and call[0] == "model_peer-1" and call[1] is registry
        base = call[2]
        assert base.model_peers == []  # a peer links to no one
    # The engine claims as many peers and shards as its options say (shards_per_group: default).
    assert base.options.model_peers == 2 and base.options.shards_per_group == 2
    # Every replica of one deploy carries the same generation; other args, another one.
    assert call[-1] == app._generation(args) != app._generation(args | {"model": "small"})
    assert base.mesh_key == "ab" * 32  # the application's, from its registry
    # The worker's own config: token_engine_threads for a token engine, num_threads otherwise.
    worker = role_config(base, Role(role), f"{role}-1")
    assert worker.num_threads == (3 if role == "token" else 1)


@pytest.mark.parametrize("name", ["local.yaml", "cluster.yaml"])
def test_the_commented_model_peer_switch_deploys_when_turned_on(name: str) -> None:
    """The config as a user turns peers on: `model_peers: 1` and the ModelPeer block uncommented."""
    lines, on = [], False
    for line in (DEPLOY / name).read_text().replace("model_peers: 0", "model_peers: 1").split("\n"):
        on = on or "# - name: ModelPeer" in line
        lines.append(line.replace("# ", "", 1) if on and line.lstrip().startswith("# ") else line)
    config = yaml.safe_load("\n".join(lines))
    ServeDeploySchema.model_validate(config)
    [app] = config["applications"]
    args = AppArgs.model_validate(app["args"])
    names = [d["name"] for d in app["deployments"]]
    assert args.mesh.model_peers == 1 and "ModelPeer" in names
    assert set(names) == set(deployment_names("mesh", args.mesh.model_peers))
    assert "ModelPeer" in bound_names(build_app(app["args"]))


def test_a_local_engine_with_more_threads_than_openmp_started_with_is_warned_about() -> None:
    from services.app import _check_openmp

    def check(omp: str, threads: int) -> bool:
        return _check_openmp({"OMP_NUM_THREADS": omp} if omp else {}, threads, "Router", cores=2)

    assert not check("1", 2)  # Ray's default for a Router of num_cpus 1
    assert check("2", 2) and check("4", 2)
    assert check("", 2)  # unset: OpenMP starts with every core


def test_a_token_engine_spinning_on_its_shards_cores_is_warned_about() -> None:
    from services.app import _check_openmp

    spinning = {"OMP_NUM_THREADS": "2"}
    passive = spinning | {"OMP_WAIT_POLICY": "PASSIVE"}
    assert not _check_openmp(spinning, 2, "TokenEngine", waits_on_shards=True, cores=2)
    assert _check_openmp(passive, 2, "TokenEngine", waits_on_shards=True, cores=2)
    # Local attention (no shards to wait on), one thread, or cores to spare: spinning is fine.
    assert _check_openmp(spinning, 2, "TokenEngine", waits_on_shards=False, cores=2)
    assert _check_openmp({}, 1, "TokenEngine", waits_on_shards=True, cores=2)
    assert _check_openmp({"OMP_NUM_THREADS": "8"}, 8, "TokenEngine", waits_on_shards=True,
                         cores=16)  # fmt: skip


def test_local_config_gives_its_token_engine_the_threads_and_openmp_it_asks_for() -> None:
    """deploy/local.yaml: 2 token-engine threads (measured faster on 2 cores, docs/mesh.md) with
    OpenMP told as much in the replica's runtime_env, and sleeping while the shards attend."""
    from common.roles import Role

    [app] = CONFIGS["local.yaml"]["applications"]
    mesh = AppArgs.model_validate(app["args"]).mesh
    token = {d["name"]: d for d in app["deployments"]}["TokenEngine"]
    env = token["ray_actor_options"]["runtime_env"]["env_vars"]
    assert mesh.threads_of(Role.TOKEN) == int(env["OMP_NUM_THREADS"]) == 2
    assert mesh.threads_of(Role.SHARD) == mesh.threads_of(Role.PROMPT) == mesh.num_threads == 1
    assert env["OMP_WAIT_POLICY"].lower() == "passive"
    assert AppArgs.model_validate({"mesh": {"num_threads": 3}}).mesh.threads_of(Role.TOKEN) == 3


@pytest.mark.parametrize(
    "limits", [{"max_waiting_requests": 0}, {"kv_wait_s": -1}, {"max_num_requests": 0}]
)
def test_admission_limits_refuse_bounds_that_admit_nothing(limits: dict[str, Any]) -> None:
    from services.router.streams import AdmissionLimits

    with pytest.raises(ValueError):
        AdmissionLimits(**limits)


def test_local_yaml_binds_seesaws_offline_group_behind_the_batch_api() -> None:
    [app] = CONFIGS["local.yaml"]["applications"]
    assert AppArgs.model_validate(app["args"]).offline is not None
    assert bound_names(build_app(app["args"]))[-1] == "OfflineGroup"
    with pytest.raises(ValueError, match="offline"):
        AppArgs.model_validate(app["args"] | {"offline": {"workers": 0}})
    # Its workers split SmolLM2 evenly (`make run`'s model); a count that does not is refused at
    # deploy time, not by a replica that would restart forever.
    with pytest.raises(ValueError, match="num_key_value_heads = 3 does not split over 2"):
        build_app(app["args"] | {"offline": {"workers": 2}})
