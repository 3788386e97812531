"""deploy/cluster.yaml on a Ray cluster of several nodes, autoscaled (issue 50, items 1, 2, 4).

Four raylets on this machine (`ray.cluster_utils.Cluster`, each its own node with its own IP on
the loopback network, as `ray start --node-ip-address` gives it): the head (GCS, dashboard, Serve's
controller and the Router, which only it has the CPU for), a compute node (`compute_node`: prompt
and token engines) and two memory nodes (`memory_node`: the attention shards, spread over them
as Serve spreads a deployment's replicas). `serve deploy` of the YAML, its model swapped for the
tiny preset and its sizes for two cores (`cluster_config`), its autoscaling policy's targets and
delays short (`AUTOSCALING_POLICY`: the YAML's policy, a test's holds) and no `mesh.host`, so each
replica binds its sockets to its own node's IP, as on a real cluster.

The official `openai` client sends every request through the head's HTTP proxy. In order:

1. Placement: engines on the compute node, one shard on each memory node, sockets on node IPs.
2. Load steps, autoscaled by the replicas' own load reports (`record_autoscaling_stats`: Serve
   never sees the engines' work, which arrives over ZeroMQ); `serve status` (`serve.status()`,
   which it prints) is watched for each change:
   - a burst of long prompts (prefill only) from many clients scales PromptEngine 1 -> 2; the new
     engine joins routing and takes prompts. The burst lasts past the router's home-role
     threshold (`mesh.pools.home_roles`, short here): the token engine's home moves to mixed
     while it decodes a greedy stream beside the burst, and back to token once the burst ends
     (issue 50's home-role acceptance; tests/integration/test_home_roles.py in detail);
   - long greedy decodes of short prompts (a KV-heavy step): PromptEngine back to 1 (the
     leaving replica drains) while TokenEngine goes to 2 and AttentionShard to 4, the new
     shards on the memory nodes; the new token engine claims the new group and decodes;
   - a trickle of short streams keeps requests in flight while the token engine and its group
     leave again (the engine drains; its shards serve it until it has left; Serve picks which
     shards stop, by node: a shard of the staying engine's group among them is replaced, its
     heads rebuilt, docs/deployment.md#autoscaling).
   The scaling runs before the node stop: a lost node changes the shard count the policy sees.
3. A memory node holding a shard of the token engine's group is stopped mid-stream
   (`Cluster.remove_node`, and every actor process on it SIGKILLed with its raylet, as when a
   machine goes, so the streams lose their shards mid-decode): its shards are lost with
   a share of each request's KV heads (or all of them, where Serve's scale-down left the group on
   one node); Serve restarts them on the other memory node, the token engine links to them and a
   prompt engine recomputes the lost heads, or, when the replacement takes longer than
   `shard_rebuild_wait_s` to start, the router re-runs the streams from their tokens
   (`docs/failures.md#a-lost-node`). The groups end whole on the surviving memory node (the
   policy still runs: the long streams may add a token engine with its group meanwhile).

Every request completes; every greedy one (each phase's, the streams the moved engine decoded and
those the node stop cut among them) with the single-process engine's text.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest
import yaml

from common.engine.core import LLMEngine
from common.model.default import default_model_path
from common.roles import Role
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer
from tests.e2e.greedy_check import assert_text_greedy_close
from tests.e2e.serve_process import REPO, SERVE_CLI, end_ray, free_port, ingress_env, on_preset

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # pydantic v1-style fields in Ray
]

API_KEY = "multinode-test-key"
COMPUTE_IP, MEMORY_IPS = "127.0.0.2", ("127.0.0.3", "127.0.0.4")
SHARDS_PER_GROUP = 2  # the tiny preset's (tests/e2e/serve_process.py PRESET_SHARDS)
# The YAML's sizes are a real cluster's (8-CPU engines, 65536-block shards); these fit two cores.
# Each replica's CPU request keeps the YAML's resources; the head's one CPU takes the Router whole,
# the compute node's 2 prompt and 2 token engines at the most, each memory node 4 shards.
MESH_SIZES = {"num_blocks": 512, "shard_num_blocks": 1024, "max_num_seqs": 64, "num_threads": 1,
              "shard_wait_s": 60}  # fmt: skip
ENGINE_CPUS = 0.25
HEALTH_CHECK_TIMEOUT_S = 10  # deploy/local.yaml's: two busy cores answer health checks late
# A prompt engine counts as full at 256 pending tokens (the burst's queue is far past it): the
# prompt side's fill is far over the decode side's for longer than the hold, so a home moves;
# once the burst ends the two settle and it moves back, each within a few seconds.
POOLS = {
    "prompt_tokens": 256,
    "home_roles": {"shift": 0.5, "settle": 0.1, "hold_s": 1.0, "cooldown_s": 2.0},
}
PROMPT_TARGET = 16  # pending prompt tokens one prompt engine carries: a burst is far above it
DECODE_TARGET = 192  # running decode tokens one token engine carries: the decode step is above it
# The YAML's policy with short holds, so that the test sees every change.
KNOBS = {"upscale_after_s": 1.0, "downscale_after_s": 3.0, "cooldown_s": 3.0, "warmup_s": 2.0}
POLICY_KWARGS = {
    "PromptEngine": {"targets": {"pending_prompt_tokens": PROMPT_TARGET}, **KNOBS},
    "TokenEngine": {"targets": {"running_decode_tokens": DECODE_TARGET}, **KNOBS},
    "AttentionShard": {"targets": {"kv_fill": 0.6}, "group_size": SHARDS_PER_GROUP},
}
SERVE_WINDOW = {
    "upscale_delay_s": 0,  # the policy's own delays apply (the YAML's too)
    "downscale_delay_s": 0,
    "look_back_period_s": 2.0,  # Serve averages each signal over this window
    "metrics_interval_s": 0.5,  # how often replicas push their reports (Ray 2.60 reads it here)
}
BOUNDS = {"PromptEngine": (1, 2), "TokenEngine": (1, 2),
          "AttentionShard": (SHARDS_PER_GROUP, 2 * SHARDS_PER_GROUP)}  # fmt: skip
SCALED = tuple(BOUNDS)
NUM_STREAMS = 3
MAX_TOKENS = 512  # the streams outlast the node stop by seconds (a cut, not a tail)
TOKENS_BEFORE_KILL = 4  # every stream has this many tokens when the memory node stops
STREAM_IDS = range(5_000_000, 5_000_000 + NUM_STREAMS)
BURST_CLIENTS = 12
BURST_PROMPT_LEN = 512
BURST_TOKENS = 1  # prefill only: the prompt engine's first token ends it
BURST_GREEDY_EVERY = 4  # the others sample: load alike, no reference to compute for them
# Beside the burst, one client's greedy decodes back to back, so that the token engine decodes
# whenever its home moves; short ones (each well under one token engine's DECODE_TARGET).
HELD_CLIENTS, HELD_PROMPT_LEN, HELD_TOKENS = 1, 8, 48
DECODE_CLIENTS = 6
DECODE_PROMPT_LEN = 8
DECODE_TOKENS = 96
DECODE_GREEDY_EVERY = 4  # the others sample (seeded): the reference check stays short
TRICKLE_CLIENTS = 2
TRICKLE_PROMPT_LEN = 8
TRICKLE_TOKENS = 24


def cluster_config(http_port: int, workdir: Path) -> dict[str, Any]:
    """deploy/cluster.yaml on the tiny preset, sized for two cores (`MESH_SIZES`, fractional
    engine CPUs, local.yaml's health-check timeout), its policy's holds short (`POLICY_KWARGS`)
    and its bounds `BOUNDS`, starting at their low ends; one Router; its HTTP on loopback."""
    config = yaml.safe_load((REPO / "deploy" / "cluster.yaml").read_text())
    on_preset(config, "tiny")
    config["http_options"] |= {"host": "127.0.0.1", "port": http_port}
    [app] = config["applications"]
    app["args"]["mesh"] |= MESH_SIZES | {"pools": POOLS}
    app["args"]["batch_store"] = str(workdir / "batches.sqlite")
    policy = app["autoscaling_policy"]
    for name, kwargs in POLICY_KWARGS.items():
        assert name in policy["policy_kwargs"], name  # the YAML's policy names each
        policy["policy_kwargs"][name] = kwargs
    for deployment in app["deployments"]:
        deployment.pop("autoscaling_config", None)
        deployment.pop("num_replicas", None)  # on_preset fixes AttentionShard's
        if deployment["name"] == "Router":
            deployment["num_replicas"] = 1
            continue
        low, high = BOUNDS[deployment["name"]]
        deployment["autoscaling_config"] = {"min_replicas": low, "initial_replicas": low,
                                            "max_replicas": high, **SERVE_WINDOW}  # fmt: skip
        deployment["ray_actor_options"]["num_cpus"] = ENGINE_CPUS
        deployment["health_check_timeout_s"] = HEALTH_CHECK_TIMEOUT_S
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
        try:
            end_ray()
        finally:
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
    return the_token_engine() is not None


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


def replica_counts(cluster: MultiNodeCluster) -> tuple[int, ...]:
    """Live replicas (a draining one included) of each of `SCALED`, by Ray's state API."""
    nodes = actor_nodes(cluster)
    return tuple(len(nodes.get(name, [])) for name in SCALED)


def prompt(i: int, length: int = 24) -> list[int]:
    """Request `i`'s prompt: its first block its own, so no two share a cached prefix."""
    return [(7919 * i + 31 * j) % 2000 + 40 for j in range(length)]


def openai_client(base_url: str) -> Any:
    import openai

    return openai.OpenAI(base_url=base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def router_stats(base_url: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return dict(httpx.get(base_url + "/stats", headers=headers, timeout=30).json())


def services_of(base_url: str, role: str) -> dict[str, Any]:
    """The services of a home role the router routes to (its registry view, `/stats`)."""
    services = router_stats(base_url)["services"]
    return {sid: s for sid, s in services.items() if s["home_role"] == role}


def served_by(base_url: str, prefix: str) -> dict[str, int]:
    """Requests the router placed on each engine whose id starts with `prefix`."""
    counts = router_stats(base_url)["requests_by_engine"]
    return {e: n for e, n in counts.items() if e.startswith(prefix)}


def token_homes(base_url: str) -> dict[str, tuple[str, int]]:
    """Each token engine's home role and the requests it holds (`/stats`)."""
    services = router_stats(base_url)["services"]
    return {sid: (s["home_role"], s["num_requests"]) for sid, s in services.items()
            if sid.startswith("token")}  # fmt: skip


class Clients:
    """Threads posting completions through the official client back to back until stopped;
    every answer is kept. Request i is greedy when `greedy_every` divides it, else sampled
    (seeded)."""

    def __init__(self, base_url: str, num_clients: int, prompt_len: int, max_tokens: int,
                 first_id: int, greedy_every: int = 1) -> None:  # fmt: skip
        self.base_url, self.prompt_len, self.max_tokens = base_url, prompt_len, max_tokens
        self.greedy_every = greedy_every
        self.stop = threading.Event()
        self.ids = itertools.count(first_id)
        self.num_ok = 0
        self.texts: dict[int, str] = {}  # the greedy ones'
        self.failures: list[str] = []
        self.num_clients = num_clients
        self._pool = ThreadPoolExecutor(num_clients)

    def _run(self) -> None:
        with openai_client(self.base_url) as client:
            while not self.stop.is_set():
                i = next(self.ids)
                greedy = i % self.greedy_every == 0
                try:
                    answer = client.completions.create(
                        model="tiny", prompt=prompt(i, self.prompt_len),
                        max_tokens=self.max_tokens, temperature=0 if greedy else 1.0, seed=i,
                        extra_body={"ignore_eos": True},
                    )  # fmt: skip
                    self.num_ok += 1
                    if greedy:
                        self.texts[i] = answer.choices[0].text
                except Exception as exc:  # noqa: BLE001 - every failure is reported
                    self.failures.append(repr(exc))

    def __enter__(self) -> Clients:
        self._clients = [self._pool.submit(self._run) for _ in range(self.num_clients)]
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self._pool.shutdown(wait=True)  # each client's request in flight finishes first
        for client in self._clients:
            client.result()  # a client thread that raised fails the test


def wait_while(clients: Clients, what: str, check: Callable[[], Any], timeout_s: float) -> None:
    """`wait_for` while `clients` run: a failed request ends the wait (the test then says why)."""
    wait_for(what, lambda: check() or clients.failures, timeout_s)


class StatusWatch:
    """What `serve status` says as it changes: each deployment's messages in order (`Upscaling
    from 1 to 2 replicas.` while the change is under way), read from `serve.status()` (what the
    CLI prints) every half second on a thread of its own."""

    def __init__(self) -> None:
        self.messages: dict[str, list[str]] = {}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="serve-status", daemon=True)

    def _run(self) -> None:
        from ray import serve

        while not self._stop.wait(0.5):  # NOTE: polling another process's state; bounded
            try:
                app = serve.status().applications["phasemesh"]
            except Exception as exc:  # noqa: BLE001 - the controller busy: read again
                self.errors.append(repr(exc))
                continue
            for name, deployment in app.deployments.items():
                seen = self.messages.setdefault(name, [])
                if deployment.message and (not seen or seen[-1] != deployment.message):
                    seen.append(deployment.message)

    def said(self, deployment: str, low: int, high: int) -> bool:
        change = f"{'Up' if high > low else 'Down'}scaling from {low} to {high} replicas."
        return change in self.messages.get(deployment, [])

    def __enter__(self) -> StatusWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def replica_log_lines(cluster: MultiNodeCluster) -> list[str]:
    """Every line the replicas of any node logged: Serve's replica logs and the workers' own
    output, where the mesh's structlog writes (one machine: one session folder)."""
    logs = Path(cluster.cluster.head_node.get_session_dir_path()) / "logs"
    assert list(logs.glob("serve/replica_*.log")), f"no replica logs under {logs}"
    files = [*logs.glob("serve/replica_*.log"), *logs.glob("worker-*.err"),
             *logs.glob("worker-*.out")]  # fmt: skip
    return [line for f in files for line in f.read_text(errors="replace").splitlines()]


@pytest.fixture(scope="module")
def reference() -> Callable[[dict[int, str], int, int], None]:
    """A check of greedy texts (request id -> text) against the single-process engine's, for
    prompts of `length` tokens and `max_tokens` each."""
    path = default_model_path("tiny")
    engine, tokenizer = LLMEngine.from_path(path, num_blocks=1024), Tokenizer(path)

    def check(texts: dict[int, str], length: int, max_tokens: int) -> None:
        ids = sorted(texts)
        prompts = [prompt(i, length) for i in ids]
        expected = engine.generate(
            prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        )
        for i, p, ref in zip(ids, prompts, expected, strict=True):
            assert_text_greedy_close(texts[i], p, ref, tokenizer, path)

    return check


def test_load_steps_scale_prompt_engines_and_token_engine_groups_1_2_1_losing_no_request(
    cluster: MultiNodeCluster, reference: Callable[[dict[int, str], int, int], None]
) -> None:
    started = time.monotonic()
    base = cluster.base_url
    counts = lambda: replica_counts(cluster)  # noqa: E731
    assert counts() == (1, 1, SHARDS_PER_GROUP) and len(services_of(base, "prompt")) == 1
    moved: list[str] = []  # token engines seen at a home other than token, decoding
    with StatusWatch() as status:
        held = Clients(base, HELD_CLIENTS, HELD_PROMPT_LEN, HELD_TOKENS, 3_000_000)
        with held, Clients(base, BURST_CLIENTS, BURST_PROMPT_LEN, BURST_TOKENS, 0,
                           BURST_GREEDY_EVERY) as burst:  # fmt: skip

            def moved_while_decoding() -> bool:
                """A token engine away from its home, holding requests (the held stream
                decodes on the only token engine all along; its prefills of the burst too)."""
                moved.extend(sid for sid, (home, num_requests) in token_homes(base).items()
                             if home != "token" and num_requests)  # fmt: skip
                return bool(moved)

            wait_while(burst, "a decoding token engine's home moved toward prompt",
                       moved_while_decoding, 120)  # fmt: skip
            wait_while(burst, "a second PromptEngine replica", lambda: counts()[0] == 2, 180)
            wait_while(burst, "2 prompt engines in routing",
                       lambda: len(services_of(base, "prompt")) == 2, 120)  # fmt: skip
            wait_while(burst, "both prompt engines taking prompts",
                       lambda: len(served_by(base, "prompt")) == 2, 60)  # fmt: skip
            assert actor_nodes(cluster)["PromptEngine"] == [COMPUTE_IP] * 2
        prompt_up_at = time.monotonic()
        assert not burst.failures and not held.failures, (burst.failures + held.failures)[:5]
        # The burst is over: the moved home goes back (its decodes finished where they ran).
        wait_for("the token engine's home back to token", lambda: all(
            home == "token" for home, _ in token_homes(base).values()), 60)  # fmt: skip
        assert services_of(base, "token")[moved[0]]["num_home_moves"] >= 2
        assert counts()[1] == 1  # prefill only: nothing for the token engines

        # Long decodes of short prompts: the prompt engines idle, the token engine's KV grows.
        with Clients(base, DECODE_CLIENTS, DECODE_PROMPT_LEN, DECODE_TOKENS, 1_000_000,
                     DECODE_GREEDY_EVERY) as decodes:  # fmt: skip
            wait_while(decodes, "PromptEngine back to 1, a token engine with its group added",
                       lambda: counts() == (1, 2, 2 * SHARDS_PER_GROUP), 180)  # fmt: skip
            wait_while(decodes, "2 token engines and their shards in routing", lambda: (
                len(services_of(base, "token")) == 2
                and len(services_of(base, "shard")) == 2 * SHARDS_PER_GROUP), 120)  # fmt: skip
            wait_while(decodes, "both token engines decoding",
                       lambda: len(served_by(base, "token")) == 2, 60)  # fmt: skip
            nodes = actor_nodes(cluster)
        group_up_at = time.monotonic()
        assert not decodes.failures, decodes.failures[:5]
        assert nodes["TokenEngine"] == [COMPUTE_IP] * 2, nodes
        assert set(nodes["AttentionShard"]) <= set(MEMORY_IPS), nodes

        # The decodes are over: short streams keep requests in flight while the group leaves.
        with Clients(base, TRICKLE_CLIENTS, TRICKLE_PROMPT_LEN, TRICKLE_TOKENS,
                     2_000_000) as trickle:  # fmt: skip
            wait_while(trickle, "the token engine and its group gone again",
                       lambda: counts() == (1, 1, SHARDS_PER_GROUP), 120)  # fmt: skip
            wait_while(trickle, "1 token engine and its shards in routing", lambda: (
                len(services_of(base, "token")) == 1
                and len(services_of(base, "shard")) == SHARDS_PER_GROUP), 60)  # fmt: skip
            num_before = trickle.num_ok
            wait_while(trickle, "requests after the scale-down",
                       lambda: trickle.num_ok > num_before + 2, 60)  # fmt: skip
        assert not trickle.failures, trickle.failures[:5]
    # `serve status` showed each change (each message lasts while its change is under way).
    changes = [("PromptEngine", 1, 2), ("PromptEngine", 2, 1), ("TokenEngine", 1, 2),
               ("TokenEngine", 2, 1), ("AttentionShard", SHARDS_PER_GROUP, 2 * SHARDS_PER_GROUP),
               ("AttentionShard", 2 * SHARDS_PER_GROUP, SHARDS_PER_GROUP)]  # fmt: skip
    for name, low, high in changes:
        assert status.said(name, low, high), (name, low, high, status.messages, status.errors[-3:])
    # The leaving replicas drained: no request lost its engine, none outlived the drain.
    lines = replica_log_lines(cluster)
    for trouble in ("engine left mid-request", "drain time over"):
        assert not [line for line in lines if trouble in line], trouble
    print(f"multinode autoscale: 2 prompt engines serving {prompt_up_at - started:.0f} s after "
          f"the burst began, 2 groups after another {group_up_at - prompt_up_at:.0f} s, back to "
          f"1 after another {time.monotonic() - group_up_at:.0f} s; {burst.num_ok} burst, "
          f"{decodes.num_ok} decode and {trickle.num_ok} trickle requests; serve status: "
          f"{status.messages}")  # fmt: skip

    for clients, length, tokens in ((burst, BURST_PROMPT_LEN, BURST_TOKENS),
                                    (held, HELD_PROMPT_LEN, HELD_TOKENS),
                                    (decodes, DECODE_PROMPT_LEN, DECODE_TOKENS),
                                    (trickle, TRICKLE_PROMPT_LEN, TRICKLE_TOKENS)):  # fmt: skip
        assert len(clients.texts) >= (1 if clients is held else 4), sorted(clients.texts)
        reference(clients.texts, length, tokens)


class Streams:
    """Greedy streamed completions through the official client, one thread each."""

    def __init__(self, base_url: str, ids: list[int]) -> None:
        self.client = openai_client(base_url)
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


def node_actor_pids(cluster: MultiNodeCluster, ip: str) -> list[int]:
    import ray
    from ray.util.state import list_actors

    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    address = f"http://127.0.0.1:{cluster.dashboard_port}"
    actors = list_actors(address, filters=[("state", "=", "ALIVE")], limit=1000)
    return [a.pid for a in actors if ips.get(a.node_id) == ip and a.pid]


def the_token_engine() -> Any:
    """The one token engine's registry entry, ready with a whole group; None meanwhile."""
    tokens = [e for e in registry_entries() if e.role == Role.TOKEN]
    whole = [e for e in tokens if e.state == "ready" and len(e.shards) == SHARDS_PER_GROUP]
    return whole[0] if len(tokens) == len(whole) == 1 else None


def test_a_memory_node_stopped_mid_stream_loses_no_request(
    cluster: MultiNodeCluster, reference: Callable[[dict[int, str], int, int], None]
) -> None:
    # Serve's scale-down picks shards by node (the fewest replicas first): the group may have
    # ended on one memory node or across both. Stop one that holds a shard of it.
    token = wait_for("one token engine with a whole group", the_token_engine, 120)
    lost = host_of(token.shards[0].kv_endpoint)
    [survivor] = [ip for ip in MEMORY_IPS if ip != lost]
    # Asked of the dashboard before the streams start, so that the stop follows their first
    # tokens at once rather than after the dashboard's answer.
    pids = node_actor_pids(cluster, lost)
    streams = Streams(cluster.base_url, list(STREAM_IDS))
    wait_for("every stream under way", lambda: streams.all_have(TOKENS_BEFORE_KILL), 120)
    assert not streams.finish, "a stream ended before the node stopped: nothing was tested"
    started = time.monotonic()
    cluster.cluster.remove_node(cluster.nodes.pop(lost), allow_graceful=False)
    for pid in pids:  # a machine lost: its processes with it, not a moment after its raylet
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with streams.lock:
        at_stop = dict(streams.num_chunks)
    streams.wait()
    print(f"multinode: streams finished {time.monotonic() - started:.1f} s after the node stopped; "
          f"chunks when it had stopped {at_stop}, in all {streams.num_chunks}")  # fmt: skip
    assert streams.finish == dict.fromkeys(streams.ids, "length"), streams.finish

    def group_on_surviving_node() -> bool:
        """Serve restarted the lost shards on the other memory node, and the token engines'
        groups hold them (streams that waited past `shard_rebuild_wait_s` were re-run instead).
        The policy still runs: the long streams may have added a token engine with its group."""
        tokens = [e for e in registry_entries() if e.role == Role.TOKEN]
        shards = sorted(actor_nodes(cluster).get("AttentionShard", []))
        groups = sorted(host_of(s.kv_endpoint) for t in tokens for s in t.shards)
        whole = all(len(t.shards) == SHARDS_PER_GROUP for t in tokens)
        return bool(tokens) and whole and shards == groups == [survivor] * len(groups)

    wait_for("the token engine's group whole again, on the surviving memory node",
             group_on_surviving_node, 90)  # fmt: skip
    reference(streams.texts, 24, MAX_TOKENS)
