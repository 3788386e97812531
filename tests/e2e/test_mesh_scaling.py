"""Scaling the mesh on a running application: TokenEngine 1 -> 2 replicas with `serve deploy`.

A Ray cluster with the dashboard is started in this process (`serve deploy` talks to the dashboard's
REST API), `deploy/local.yaml` is deployed on a free port, and client threads stream requests the
whole time. Re-deploying the YAML with `TokenEngine.num_replicas: 2` must bring a second token
engine into routing (it receives requests: the router's per-engine counter in `/stats`) without a
single failed request: every stream answers 200, the exact number of tokens, usage and `[DONE]`.
Last, the same YAML with its ModelPeer block on (Lamina 4.3's rotation over model replicas) is
deployed over the running application, and a peer replica killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from common.engine.core import LLMEngine
from common.model.default import default_model_path
from common.protocol import EngineStats
from common.roles import Role
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer
from common.transport.service_stats import request_stats
from common.transport.zmq_auth import CurveKeys
from services.mesh.absence import ABSENT_CONFIRM_S
from services.mesh.ray_registry import RayRegistry
from tests.e2e.greedy_check import assert_text_greedy_close
from tests.e2e.serve_process import (
    REPO,
    SERVE_CLI,
    end_ray,
    free_port,
    ingress_env,
    on_preset,
    replica_pid_below,
    router_port,
)

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # pydantic v1-style fields in Ray
]

NUM_TOKENS = 8
NUM_CLIENTS = 2
PROMPT_POOL_FULL = 64


class Cluster:
    """A local Ray with its dashboard, owned by this test process."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.dashboard_port = free_port()
        self.http_port = free_port()
        self.proxy_url = f"http://127.0.0.1:{self.http_port}"
        self.base_url = self.proxy_url  # the Router replica's own once deployed (direct ingress)
        self.ingress = ingress_env("direct")  # as `make run`: Serve reads it where Ray starts
        self._saved_env = {k: os.environ.get(k) for k in self.ingress}

    def start(self) -> None:
        # Workers (replicas) inherit this environment from the raylet ray.init starts.
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(REPO), os.environ.get("PYTHONPATH")])
        )
        os.environ.update(self.ingress)
        # NOTE: token auth, Ray 2.60's default for clusters it starts, said explicitly. Ray caches
        # the mode when it is imported: if another module imported it first with the variable
        # unset, ray.init() turns token auth on itself (and exports it to `serve deploy`).
        if "RAY_AUTH_MODE" not in os.environ and "ray" not in sys.modules:
            os.environ["RAY_AUTH_MODE"] = "token"
        import ray

        ray.init(
            address="local", num_cpus=2, include_dashboard=True, dashboard_host="127.0.0.1",
            dashboard_port=self.dashboard_port, log_to_driver=False,
        )  # fmt: skip

    def deploy(
        self, num_token_engines: int, model_peers: int = 0, mesh: dict[str, Any] | None = None
    ) -> None:
        """`serve deploy` deploy/local.yaml on our port with this many token engines; with
        `model_peers`, its commented ModelPeer block turned on (that many per token engine), and
        `mesh` args set over the file's."""
        text = (REPO / "deploy" / "local.yaml").read_text()
        config = yaml.safe_load(uncomment_model_peers(text) if model_peers else text)
        on_preset(config, "tiny")  # the file's own model is `make run`'s SmolLM2
        config["http_options"]["port"] = self.http_port
        [app] = config["applications"]
        for deployment in app["deployments"]:
            if deployment["name"] == "TokenEngine":
                deployment["num_replicas"] = num_token_engines
            if deployment["name"] == "ModelPeer":
                deployment["num_replicas"] = num_token_engines * model_peers
        # A prompt engine counts as full past 64 pending prompt tokens: the steady 4-token load
        # never gets there, a burst of long prompts does (a token engine is lent to the mixed pool).
        app["args"]["mesh"]["pools"] = {"prompt_tokens": PROMPT_POOL_FULL, "lease_s": 10.0}
        # No `key`: every deploy's replicas take the application's from its registry, so a
        # deploy that rolls every replica stays one mesh (a key drawn per deploy split it).
        app["args"]["mesh"] |= {"model_peers": model_peers} | (mesh or {})
        # No offline group (its deployment is not what these tests scale), the Batch API's store
        # beside the config.
        app["args"] |= {"offline": None, "batch_store": str(self.workdir / "batches.sqlite")}
        path = self.workdir / f"local-{num_token_engines}-{model_peers}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        address = f"http://127.0.0.1:{self.dashboard_port}"
        subprocess.run(
            [str(SERVE_CLI), "deploy", str(path), "-a", address], check=True, cwd=REPO,
            env=os.environ | {"RAY_ADDRESS": ""}, timeout=120,
        )  # fmt: skip

    def use_direct_ingress(self) -> None:
        """Point `base_url` at the Router replica's own HTTP server (the proxy answered)."""
        low = int(self.ingress["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"])
        self.base_url = f"http://127.0.0.1:{router_port(os.getpid(), low)}"

    def metrics_url(self) -> str:
        """Ray's metrics agent (Prometheus text) of the Ray this process started."""
        import ray

        node = ray._private.worker._global_node
        assert node is not None
        return f"http://127.0.0.1:{node.metrics_export_port}/metrics"

    def stop(self) -> None:
        try:
            end_ray()
        finally:
            for key, value in self._saved_env.items():  # later tests start Ray without it
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def uncomment_model_peers(text: str) -> str:
    """deploy/local.yaml as its comment says to turn peers on: the ModelPeer block uncommented."""
    lines, on = [], False
    for line in text.split("\n"):
        on = on or "# - name: ModelPeer" in line
        lines.append(line.replace("# ", "", 1) if on and line.lstrip().startswith("# ") else line)
    return "\n".join(lines)


def replica_states() -> dict[str, dict[str, int]]:
    """Each deployment's replicas by state ({} while the application is not there)."""
    from ray import serve

    app = serve.status().applications.get("phasemesh")
    if app is None:
        return {}
    return {name: dict(d.replica_states) for name, d in app.deployments.items()}


def token_engine_replicas() -> dict[str, int]:
    return replica_states().get("TokenEngine", {})


def wait_for(what: str, check: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.5)  # NOTE: waiting on other processes' start-up; nothing to block on
    raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")


def healthy(base_url: str) -> bool:
    try:
        return httpx.get(base_url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def stats(base_url: str) -> dict[str, Any]:
    return httpx.get(base_url + "/stats", timeout=10).json()


def complete_all(base_url: str, prompts: list[list[int]]) -> list[str]:
    """Greedy completions of 8 tokens, all at once; each must answer 200."""

    def complete(prompt: list[int]) -> str:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        response = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return str(response.json()["choices"][0]["text"])

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(complete, prompts))


def stream_once(http: httpx.Client, prompt: list[int]) -> None:
    """One streamed completion; raises AssertionError unless it is complete and exact."""
    body = {
        "model": "tiny", "prompt": prompt, "max_tokens": NUM_TOKENS, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}, "temperature": 0,
    }  # fmt: skip
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        events = [line[len("data: ") :] for line in response.iter_lines() if line]
    assert events and events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), chunks
    token_chunks = [c for c in chunks if c["choices"]]
    # Tokens that reach the router together leave as one chunk; usage counts every token.
    assert 1 <= len(token_chunks) <= NUM_TOKENS, len(token_chunks)
    assert token_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == NUM_TOKENS


class Load:
    """Client threads streaming requests back to back until stopped; counts what happened."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.stop = threading.Event()
        self.num_ok = 0
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(NUM_CLIENTS)]

    def _run(self, client: int) -> None:
        with httpx.Client(base_url=self.base_url, timeout=60) as http:
            i = 0
            while not self.stop.is_set():
                try:
                    stream_once(http, [10 + client, 20 + i % 50, 30, 40 + i % 7])
                    self.num_ok += 1
                except Exception as exc:  # noqa: BLE001 - every failure is reported
                    self.failures.append(repr(exc))
                i += 1

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path_factory.mktemp("scaling"))
    cluster.start()
    try:
        cluster.deploy(num_token_engines=1)
        wait_for("a healthy application", lambda: healthy(cluster.proxy_url), 240)
        cluster.use_direct_ingress()
        wait_for("a healthy Router replica", lambda: healthy(cluster.base_url), 60)
        yield cluster
    finally:
        cluster.stop()


def test_scaling_token_engines_adds_a_replica_to_routing_without_failures(
    cluster: Cluster,
) -> None:
    with Load(cluster.base_url) as load:
        wait_for("requests flowing", lambda: load.num_ok >= 4 or load.failures, 60)
        before = {e for e in stats(cluster.base_url)["requests_by_engine"] if e.startswith("token")}
        assert len(before) == 1, before
        cluster.deploy(num_token_engines=2)
        wait_for("2 running token engines", lambda: token_engine_replicas() == {"RUNNING": 2}, 240)

        def new_engine_served() -> bool:
            counts = stats(cluster.base_url)["requests_by_engine"]
            return any(
                e.startswith("token") and e not in before and n >= 3 for e, n in counts.items()
            )

        wait_for("the new token engine to serve requests", new_engine_served, 60)
    assert not load.failures, load.failures[:5]
    assert load.num_ok >= 10
    services = stats(cluster.base_url)["services"]
    assert [s["role"] for s in services.values()].count("token") == 2
    assert all(s["kv_blocks_used"] == 0 for s in services.values()), services


def test_a_prompt_burst_lends_a_token_engine_to_the_mixed_pool_and_back(cluster: Cluster) -> None:
    """Splitwise's pools as the engines' own state (docs/serving.md): a burst of long prompts
    fills the prompt pool, the router lends one token engine to the mixed pool (`SetRole`), the
    engine reports it (`/stats`: its current role and its loans), and it goes home once the
    burst drains; every request's greedy output is the single-process engine's."""
    wait_for("2 running token engines", lambda: token_engine_replicas() == {"RUNNING": 2}, 240)
    path = default_model_path("tiny")
    engine, tokenizer = LLMEngine.from_path(path, num_blocks=512), Tokenizer(path)
    prompts = [[(7 * i + j) % 1500 + 100 for j in range(150)] for i in range(12)]
    expected = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0,
                                                       ignore_eos=True))  # fmt: skip
    loans_before = {
        sid: s.get("num_loans", 0) for sid, s in stats(cluster.base_url)["services"].items()
    }

    texts = complete_all(cluster.base_url, prompts)
    for text, prompt, ids in zip(texts, prompts, expected, strict=True):
        assert_text_greedy_close(text, prompt, ids, tokenizer, path)

    def lent_token_engines() -> list[str]:
        services = stats(cluster.base_url)["services"]
        return [sid for sid, s in services.items() if s["home_role"] == "token"
                and s.get("num_loans", 0) > loans_before.get(sid, 0)]  # fmt: skip

    lent = wait_for("a token engine lent to the mixed pool", lent_token_engines, 30)
    assert len(lent) == 1, lent  # never the last of its pool
    # ... and in the engines' metrics (Ray's workers report every few seconds: poll, bounded).
    try:
        wait_for("the loan in the engines' metrics", lambda: pool_loans(cluster.metrics_url()), 90)
    except TimeoutError:
        text = httpx.get(cluster.metrics_url(), timeout=10).text
        raise AssertionError([line for line in text.splitlines() if "pool" in line]) from None

    def all_home() -> bool:
        services = stats(cluster.base_url)["services"]
        return all(s["role"] == s["home_role"] for s in services.values())

    wait_for("every engine back in its home pool", all_home, 60)
    services = stats(cluster.base_url)["services"]
    assert all(s["kv_blocks_used"] == 0 for s in services.values()), services


def pool_loans(metrics_url: str) -> float:
    """`phasemesh_pool_loans_total` of token engines, summed, from Ray's metrics agent."""
    exposition = httpx.get(metrics_url, timeout=10).text
    pattern = re.compile(
        r"^ray_phasemesh_pool_loans_total(?:_total)?\{[^}]*home=\"token\"[^}]*\} (\S+)$",
        re.MULTILINE,
    )
    return sum(float(value) for value in pattern.findall(exposition))


def test_a_token_engine_rotates_over_a_model_peer_replica_and_claims_its_replacement(
    cluster: Cluster,
) -> None:
    """Lamina 4.3 over Serve replicas (docs/mesh.md): deploy/local.yaml with `model_peers: 1`,
    3 decode lanes and its ModelPeer block on. The token engine claims the peer through the
    registry and runs slices on it (its `EngineStats`), greedy text equal to the single-process
    engine's; the peer's process is killed, Serve replaces it, the engine's watch claims and
    links the replacement (`LinkPeers`), and the next requests run on it, still equal."""
    # One token engine: a second would find the shard group taken and decode locally, no peers.
    cluster.deploy(num_token_engines=1, model_peers=1, mesh={"decode_lanes": 3})
    want = {"Router": 1, "PromptEngine": 1, "TokenEngine": 1, "AttentionShard": 2, "ModelPeer": 1}
    running = {name: {"RUNNING": n} for name, n in want.items()}
    wait_for("the redeployed application", lambda: replica_states() == running, 240)
    base_url = cluster.proxy_url  # the Router replica was replaced: its own port may differ
    wait_for("a healthy application", lambda: healthy(base_url), 60)
    path = default_model_path("tiny")
    engine, tokenizer = LLMEngine.from_path(path, num_blocks=512), Tokenizer(path)
    prompts = [[(11 * i + j) % 1500 + 100 for j in range(24)] for i in range(4)]
    expected = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0,
                                                       ignore_eos=True))  # fmt: skip

    def check_greedy(few: int) -> None:
        texts = complete_all(base_url, prompts[:few])
        for text, prompt, ids in zip(texts, prompts, expected, strict=False):
            assert_text_greedy_close(text, prompt, ids, tokenizer, path)

    linked = wait_for("the token engine linked to its peer", lambda: peered_token_engine(1), 60)

    # The redeploy changed the args, so Serve replaced every mesh replica: the token engine
    # holds only shards and a peer of its own generation, never an old one Serve is stopping.
    live = {e.service_id: e for e in RayRegistry.for_app("phasemesh").live()}
    [token] = [e for e in live.values() if e.service_id == linked.service_id]
    held = [s.service_id for s in token.shards] + list(token.peers)
    assert held and all(live[h].generation == token.generation for h in held if h in live), held

    def ran_slices_on_the_peer() -> EngineStats | None:
        # Requests until one ran slices on the peer: the engine links its group and peers
        # between steps, and a group lost meanwhile is relinked (requests migrate, text equal).
        check_greedy(1)
        stats = peered_token_engine(1)
        return stats if stats is not None and stats.num_peer_slices > 0 else None

    before = wait_for("a request decoded over the peer", ran_slices_on_the_peer, 120)
    check_greedy(len(prompts))
    first = peered_token_engine(1)
    assert first is not None and first.service_id == linked.service_id
    assert first.num_peer_slices > before.num_peer_slices and first.num_peers_lost == 0, first

    [killed] = ready_model_peers()
    os.kill(replica_pid_below(os.getpid(), "ModelPeer"), signal.SIGKILL)
    replaced = wait_for("the replacement peer linked", lambda: peered_token_engine(2), 120)
    assert killed not in ready_model_peers()
    assert replaced.service_id == first.service_id  # the same engine: nothing else restarted
    check_greedy(2)
    after = peered_token_engine(2)
    assert after is not None and after.num_peer_slices > replaced.num_peer_slices, after
    assert after.num_peers_lost == 0, after  # lost while idle: the keeper unlinked it first
    seen = stats(base_url)["services"][after.service_id]  # the router's /stats says the same
    assert (seen["num_peer_slices"], seen["num_peers_joined"]) == (
        after.num_peer_slices, after.num_peers_joined), seen  # fmt: skip
    # The replacement registers (and is linked) inside its constructor; Serve marks it RUNNING
    # only after the constructor returns and a controller round sees it: wait, bounded.
    wait_for("Serve to see the replacement running",
             lambda: replica_states().get("ModelPeer") == {"RUNNING": 1}, 60)  # fmt: skip


def ready_model_peers() -> list[str]:
    registry = RayRegistry.for_app("phasemesh")
    return [
        e.service_id for e in registry.live() if e.role == Role.MODEL_PEER and e.state == "ready"
    ]


def peered_token_engine(min_joined: int) -> EngineStats | None:
    """The one ready token engine's stats (asked on its control socket, the registry's view,
    whichever router replica serves), once it has a shard group and made `min_joined` links."""
    registry = RayRegistry.for_app("phasemesh")
    tokens = [e for e in registry.live() if e.role == Role.TOKEN and e.state == "ready"]
    if len(tokens) != 1 or not tokens[0].shards:
        return None
    # The application's key, agreed by its first replica (a proposal now changes nothing).
    auth = CurveKeys.from_mesh_key(registry.agree_key(secrets.token_hex(32)))
    replies = list(request_stats([tokens[0].control_endpoint], 5.0, auth=auth).values())
    if not replies or replies[0].num_peers_joined < min_joined:
        return None
    return replies[0]


def test_a_restarted_registry_actor_keeps_the_applications_mesh_key(cluster: Cluster) -> None:
    """The registry actor restarts with an empty dict (`max_restarts=-1`); the mesh key is kept
    in the GCS key-value store, so a replica started after the restart still gets the running
    replicas' key (a new one would split the mesh), and the replicas re-register on their next
    heartbeat: the application serves on."""
    import ray

    key = RayRegistry.for_app("phasemesh").agree_key(secrets.token_hex(32))
    groups_before = shard_groups()
    relinks_before = group_relinks(cluster)
    ray.kill(RayRegistry.for_app("phasemesh").handle, no_restart=False)

    def token_engine_back() -> bool:
        try:
            live = RayRegistry.for_app("phasemesh").live()
        except Exception:  # noqa: BLE001 - the actor is restarting
            return False
        return any(e.role == Role.TOKEN and e.state == "ready" for e in live)

    wait_for("the replicas back in the restarted registry", token_engine_back, 60)
    assert RayRegistry.for_app("phasemesh").agree_key(secrets.token_hex(32)) == key

    def completes() -> bool:
        # While the replicas re-register (and the token engine re-claims its group) the router
        # may answer 503 with Retry-After, the documented "no engine ready": clients retry.
        body = {"model": "tiny", "prompt": [101, 102, 103, 104], "max_tokens": 8}
        response = httpx.post(cluster.proxy_url + "/v1/completions", json=body, timeout=120)
        assert response.status_code in (200, 503), response.text
        return response.status_code == 200 and bool(response.json()["choices"][0]["text"])

    wait_for("a completion after the restart", completes, 60)
    # No token engine dropped its group for the registry's empty second (its keeper waits
    # `ABSENT_CONFIRM_S` before a shard counts as lost), and the re-registered token engines'
    # entries claimed their shards again: the shards no engine holds are exactly the rest.
    time.sleep(ABSENT_CONFIRM_S + 1.0)
    assert shard_groups() == groups_before
    assert group_relinks(cluster) == relinks_before  # not even dropped and claimed back
    registry = RayRegistry.for_app("phasemesh")
    num_live, num_unclaimed = registry.shard_census()
    num_held = sum(len(group) for group in groups_before.values())
    assert num_unclaimed == num_live - num_held, (num_live, num_unclaimed, groups_before)


def group_relinks(cluster: Cluster) -> dict[str, int]:
    """Each token engine's shard group changes since it started, from the router's `/stats`."""
    services = stats(cluster.proxy_url)["services"]
    return {sid: s["num_group_relinks"] for sid, s in services.items() if s["home_role"] == "token"}


def shard_groups() -> dict[str, list[str]]:
    """Each ready token engine's shard group as its registry entry lists it."""
    live = RayRegistry.for_app("phasemesh").live()
    return {
        e.service_id: [s.service_id for s in e.shards]
        for e in live
        if e.role == Role.TOKEN and e.state == "ready"
    }


def test_routers_share_the_head_nodes_batch_store_and_one_finishes_a_stopped_ones_batch(
    cluster: Cluster,
) -> None:
    """`batch_store: ray:<path>`: two Routers (in this process, each over its own engine) reach
    one store actor on the head, so a batch made through one is seen by the other. The first runs
    part of it and stops (its lease left to run out) and the store actor's process is killed;
    Ray restarts it from the SQLite file, the second Router claims the batch and finishes it:
    every line in the output once, each equal to the online API's greedy answer."""
    import asyncio

    import ray

    from services.router.batch_api import asgi_caller
    from services.router.engine_client import InProcessEngineClient
    from services.router.server import Router

    tiny = default_model_path("tiny")
    spec = f"ray:{cluster.workdir / 'shared-batches.sqlite'}"
    routers = [Router(InProcessEngineClient(LLMEngine.from_path(tiny, num_blocks=64)), tiny,
                      "tiny", batch_store=spec, batch_lease_s=2.0) for _ in range(2)]  # fmt: skip
    try:
        first, second = (r.batches for r in routers)
        assert first is not None and second is not None
        bodies = [{"model": "tiny", "prompt": f"shared store {i}", "max_tokens": 4,
                   "temperature": 0} for i in range(8)]  # fmt: skip
        content = "\n".join(json.dumps({"custom_id": f"r{i}", "method": "POST",
                                        "url": "/v1/completions", "body": b})
                            for i, b in enumerate(bodies)).encode()  # fmt: skip
        file_id = first.store.create_file("batch", "in.jsonl", content)["id"]
        batch_id = second.store.create_batch(file_id, "/v1/completions", "24h", None)["id"]

        def done_lines() -> int:
            return int(second.store.get_batch(batch_id)["request_counts"]["completed"])

        async def run() -> None:
            first.runner.concurrency = 1
            assert first.store.claim(first.runner.owner, 2.0) == batch_id
            stopped = asyncio.create_task(first.runner.run_batch(batch_id))
            deadline = time.monotonic() + 60
            while done_lines() < 3:
                assert time.monotonic() < deadline, "the first router ran no lines"
                await asyncio.sleep(0.05)
            stopped.cancel()  # the first router stops mid-batch: its lease stays until it runs out
            with contextlib.suppress(asyncio.CancelledError):
                await stopped
            kept = done_lines()
            ray.kill(first.store.handle, no_restart=False)  # type: ignore[attr-defined]

            def claimed() -> str | None:
                try:
                    return second.store.claim(second.runner.owner, 2.0)
                except Exception:  # noqa: BLE001 - the actor is restarting
                    return None

            assert wait_for("the restarted store, the lease run out", claimed, 60) == batch_id
            # Nothing committed was lost with the actor's process. A line's write already on its way
            # when the first router stopped (a store call runs on a worker thread, which cancelling
            # the batch's task does not stop) may land after `kept` was read: at least, not equal.
            assert done_lines() >= kept
            await second.runner.run_batch(batch_id)

        asyncio.run(run())
        batch = second.store.get_batch(batch_id)
        assert batch["status"] == "completed"
        assert batch["request_counts"] == {"total": 8, "completed": 8, "failed": 0}
        out = [
            json.loads(x) for x in first.store.file_content(batch["output_file_id"]).splitlines()
        ]
        assert [x["custom_id"] for x in out] == [f"r{i}" for i in range(8)]  # each line once

        async def online() -> list[str]:
            call = asgi_caller(routers[0].app, None)
            return [(await call("/v1/completions", b))[1]["choices"][0]["text"] for b in bodies]

        assert [x["response"]["body"]["choices"][0]["text"] for x in out] == asyncio.run(online())
    finally:
        for router in routers:  # their engine threads and worker pools
            router.shutdown()
            router.client.shutdown()  # type: ignore[attr-defined]
