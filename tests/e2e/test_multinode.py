"""deploy/cluster.yaml on a Ray cluster of several nodes (issue 50, item 4).

Four raylets on this machine (`ray.cluster_utils.Cluster`, each its own node with its own IP on
the loopback network, as `ray start --node-ip-address` gives it): the head (GCS, dashboard, Serve's
controller and the Router, which only it has the CPU for), a compute node (`compute_node`: the
prompt and the token engine) and two memory nodes (`memory_node`: one attention shard each, as
Serve spreads a deployment's replicas). `serve deploy` of the YAML, its model swapped for the
tiny preset and its sizes for two cores (`cluster_config`), and nothing else set: no `mesh.host`,
so each replica binds its sockets to its own node's IP, as on a real cluster.

The official `openai` client streams greedy completions through the head's HTTP proxy: prompts are
prefilled on the compute node, their KV shipped over UCX to the shards on the memory nodes, and
every decode layer's attention crosses to them and back. One memory node is stopped mid-stream
(`Cluster.remove_node`: its raylet and every process on it killed): its shard is lost with a share
of each request's KV heads; Serve restarts the shard on the other memory node, the token engine
links to it and a prompt engine recomputes the lost heads, or, when the replacement takes longer
than `shard_rebuild_wait_s` to start, the router re-runs the streams from their tokens
(`docs/failures.md#a-lost-node`). Either way every stream finishes with the single-process
engine's greedy text, and the group ends whole on the surviving memory node.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from common.engine.core import LLMEngine
from common.model.default import default_model_path
from common.roles import Role
from common.sampling import SamplingParams
from common.tokenizer import Tokenizer
from tests.e2e.greedy_check import assert_text_greedy_close
from tests.e2e.serve_process import REPO, SERVE_CLI, free_port, ingress_env, on_preset

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # pydantic v1-style fields in Ray
]

API_KEY = "multinode-test-key"
COMPUTE_IP, MEMORY_IPS = "127.0.0.2", ("127.0.0.3", "127.0.0.4")
# The YAML's sizes are a real cluster's (8-CPU engines, 65536-block shards); these fit two cores.
# Each replica's CPU request keeps the YAML's resources; the head's one CPU takes the Router whole.
MESH_SIZES = {"num_blocks": 512, "shard_num_blocks": 1024, "max_num_seqs": 64, "num_threads": 1,
              "shard_wait_s": 60}  # fmt: skip
REPLICAS = {"Router": 1, "PromptEngine": 1, "TokenEngine": 1, "AttentionShard": 2}
ENGINE_CPUS = 0.25
NUM_STREAMS = 3
MAX_TOKENS = 96
TOKENS_BEFORE_KILL = 4  # every stream has this many tokens when the memory node stops


def cluster_config(http_port: int, workdir: Path) -> dict[str, Any]:
    """deploy/cluster.yaml on the tiny preset, sized for two cores (`MESH_SIZES`, fractional
    engine CPUs, fixed replica counts instead of the autoscaling policy), its HTTP on loopback."""
    config = yaml.safe_load((REPO / "deploy" / "cluster.yaml").read_text())
    on_preset(config, "tiny")
    config["http_options"] |= {"host": "127.0.0.1", "port": http_port}
    [app] = config["applications"]
    app["args"]["mesh"] |= MESH_SIZES
    app["args"]["batch_store"] = str(workdir / "batches.sqlite")
    for deployment in app["deployments"]:
        deployment.pop("autoscaling_config", None)
        deployment["num_replicas"] = REPLICAS[deployment["name"]]
        if deployment["name"] != "Router":
            deployment["ray_actor_options"]["num_cpus"] = ENGINE_CPUS
    return config


class MultiNodeCluster:
    """A head and three worker raylets on this machine, owned by this test process."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.dashboard_port = free_port()
        self.http_port = free_port()
        self.base_url = f"http://127.0.0.1:{self.http_port}"  # the head's Serve proxy
        # Replicas inherit the raylets' environment: the repository, the API key (the YAML's
        # header: in every node's environment), Serve's proxy path (no direct ingress).
        self.env = ingress_env("proxy") | {
            "PHASEMESH_API_KEY": API_KEY,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }
        self._saved_env = {k: os.environ.get(k) for k in self.env}
        self.nodes: dict[str, Any] = {}
        self.cluster: Any = None

    def start(self) -> None:
        os.environ.update(self.env)
        # NOTE: token auth, Ray 2.60's default, said explicitly (tests/e2e/test_mesh_scaling.py).
        if "RAY_AUTH_MODE" not in os.environ and "ray" not in sys.modules:
            os.environ["RAY_AUTH_MODE"] = "token"
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=1, gcs_server_port=free_port(), include_dashboard=True,
            dashboard_host="127.0.0.1", dashboard_port=self.dashboard_port,
            dashboard_agent_listen_port=free_port(),
        ))  # fmt: skip
        workers = [(COMPUTE_IP, "compute_node"), *((ip, "memory_node") for ip in MEMORY_IPS)]
        for ip, resource in workers:
            self.nodes[ip] = self.cluster.add_node(
                num_cpus=1, node_ip_address=ip, resources={resource: 1},
                # Each node's Serve proxy on a port of its own (one machine: they would collide).
                env_vars={"RAY_SERVE_WORKER_PROXY_HTTP_PORT": str(free_port())},
            )  # fmt: skip
        self.cluster.connect()

    def deploy(self, config: dict[str, Any]) -> None:
        path = self.workdir / "cluster.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        subprocess.run(
            [str(SERVE_CLI), "deploy", str(path), "-a", f"http://127.0.0.1:{self.dashboard_port}"],
            check=True, cwd=REPO, env=os.environ | {"RAY_ADDRESS": ""}, timeout=120,
        )  # fmt: skip

    def stop(self) -> None:
        import ray
        from ray import serve

        try:
            if ray.is_initialized():
                serve.shutdown()
        finally:
            ray.shutdown()
            if self.cluster is not None:  # None: the head did not start (its processes end
                self.cluster.shutdown()  # with this process, Ray's exit hook)
            for key, value in self._saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MultiNodeCluster]:
    c = MultiNodeCluster(tmp_path_factory.mktemp("multinode"))
    try:
        c.start()
        c.deploy(cluster_config(c.http_port, c.workdir))
        wait_for("the application running", app_running, 300)
        wait_for("a ready token engine with its shard group", group_ready, 120)
        yield c
    finally:
        c.stop()


def wait_for(what: str, check: Callable[[], Any], timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.5)  # NOTE: waiting on other processes (Serve's controller, replicas); bounded
    raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")


def app_running() -> bool:
    from ray import serve

    app = serve.status().applications.get("phasemesh")
    return app is not None and app.status == "RUNNING"


def registry_entries() -> list[Any]:
    from services.mesh.ray_registry import RayRegistry

    return RayRegistry.for_app("phasemesh").live()


def group_ready() -> bool:
    entries = registry_entries()
    return any(e.role == Role.TOKEN and e.state == "ready" and len(e.shards) == 2 for e in entries)


def actor_nodes(cluster: MultiNodeCluster) -> dict[str, list[str]]:
    """Each deployment's live replicas (and each other actor class's), by the IP of the node Ray
    runs them on (Ray's state API, asked of this cluster's dashboard: left to find one, it takes
    the machine's latest)."""
    import ray
    from ray.util.state import list_actors

    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    found: dict[str, list[str]] = {}
    address = f"http://127.0.0.1:{cluster.dashboard_port}"
    for actor in list_actors(address, filters=[("state", "=", "ALIVE")], limit=1000):
        name = actor.class_name.removeprefix("ServeReplica:phasemesh:")
        found.setdefault(name, []).append(ips[actor.node_id])
    return found


def host_of(endpoint: str) -> str:
    return str(urlparse(endpoint).hostname)


def test_replicas_land_on_the_nodes_the_yaml_resources_name(cluster: MultiNodeCluster) -> None:
    nodes = actor_nodes(cluster)
    assert sorted(nodes["PromptEngine"]) == [COMPUTE_IP], nodes
    assert sorted(nodes["TokenEngine"]) == [COMPUTE_IP], nodes
    assert sorted(nodes["AttentionShard"]) == sorted(MEMORY_IPS), nodes  # spread: one each
    head = cluster.cluster.head_node.node_ip_address
    assert nodes["Router"] == [head], nodes  # the only node with a whole CPU free
    assert nodes["Registry"] == [head], nodes  # no worker node's loss restarts it
    # No mesh host in the YAML: each replica's sockets are on its own node's IP.
    for entry in registry_entries():
        node = {Role.PROMPT: [COMPUTE_IP], Role.TOKEN: [COMPUTE_IP]}.get(entry.role, MEMORY_IPS)
        assert host_of(entry.control_endpoint) in node, entry
        if entry.role == Role.TOKEN:  # its group: one shard on each memory node
            assert sorted(host_of(s.kv_endpoint) for s in entry.shards) == sorted(MEMORY_IPS)


def prompt(i: int, length: int = 24) -> list[int]:
    return [(7919 * i + 31 * j) % 2000 + 40 for j in range(length)]


class Streams:
    """Greedy streamed completions through the official client, one thread each."""

    def __init__(self, base_url: str, ids: list[int]) -> None:
        import openai

        self.client = openai.OpenAI(base_url=base_url + "/v1", api_key=API_KEY, max_retries=0,
                                    timeout=300)  # fmt: skip
        self.ids = ids
        self.texts = {i: "" for i in ids}
        self.num_chunks = dict.fromkeys(ids, 0)
        self.finish: dict[int, str | None] = {}
        self.lock = threading.Lock()
        self._pool = ThreadPoolExecutor(len(ids))
        self._futures = [self._pool.submit(self._run, i) for i in ids]

    def _run(self, i: int) -> None:
        stream = self.client.completions.create(
            model="tiny", prompt=prompt(i), max_tokens=MAX_TOKENS, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        for chunk in stream:
            choice = chunk.choices[0]
            with self.lock:
                self.texts[i] += choice.text
                self.num_chunks[i] += 1
                if choice.finish_reason is not None:
                    self.finish[i] = choice.finish_reason

    def all_have(self, num_chunks: int) -> bool:
        with self.lock:
            return all(n >= num_chunks for n in self.num_chunks.values())

    def wait(self) -> None:
        self._pool.shutdown(wait=True)
        for future in self._futures:
            future.result()  # a stream that failed fails the test
        self.client.close()


def test_a_memory_node_stopped_mid_stream_loses_no_request(cluster: MultiNodeCluster) -> None:
    streams = Streams(cluster.base_url, list(range(NUM_STREAMS)))
    wait_for("every stream under way", lambda: streams.all_have(TOKENS_BEFORE_KILL), 120)
    assert not streams.finish, "a stream ended before the node stopped: nothing was tested"
    started = time.monotonic()
    cluster.cluster.remove_node(cluster.nodes.pop(MEMORY_IPS[1]), allow_graceful=False)
    streams.wait()
    print(f"multinode: streams finished {time.monotonic() - started:.1f} s after the node stopped")
    assert streams.finish == dict.fromkeys(streams.ids, "length"), streams.finish

    def group_on_surviving_node() -> bool:
        """Serve restarted the lost shard on the other memory node, and the token engine's group
        holds it (streams that waited past `shard_rebuild_wait_s` for it were re-run instead)."""
        [token] = [e for e in registry_entries() if e.role == Role.TOKEN]
        shards = sorted(actor_nodes(cluster).get("AttentionShard", []))
        group = [host_of(s.kv_endpoint) for s in token.shards]
        return shards == group == [MEMORY_IPS[0]] * 2

    wait_for("the token engine's group whole again, on the surviving memory node",
             group_on_surviving_node, 90)  # fmt: skip

    path = default_model_path("tiny")
    engine, tokenizer = LLMEngine.from_path(path, num_blocks=256), Tokenizer(path)
    prompts = [prompt(i) for i in streams.ids]
    expected = engine.generate(
        prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    )
    for i, p, ref in zip(streams.ids, prompts, expected, strict=True):
        assert_text_greedy_close(streams.texts[i], p, ref, tokenizer, path)
