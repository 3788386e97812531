"""The served OpenAPI schema, fuzzed: schemathesis against `serve run deploy/local.yaml` (the mesh).

Coverage and fuzzing phases, more than a thousand generated requests in all, checked for server
errors, undocumented status codes and responses that do not match the documented schema. The
router's context is capped (`max_model_len: 40`) so that each accepted request generates a dozen
or so tokens at most (a chat prompt's template alone is 26): the run stays within a couple of
minutes on two cores. Afterwards the mesh still serves a normal request, and every engine and
shard is back to idle.

The same application checks what is closed by default: it runs with an API key (401 without it,
`/health` open), and no socket PhaseMesh opens in its replicas listens beyond loopback. Last, a
soak of mixed normal, cut-off, oversized and hostile requests must leave every service idle and
every replica's memory within a bound.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.e2e.serve_process import ServeRun, descendants, served
from tests.unit.test_prompt_bounds import HOSTILE_CHAT_BODIES

pytestmark = pytest.mark.timeout(600)

MIN_CASES = 1000
# Every token a fuzzed request may generate is served by the mesh on CI's two cores, and most of
# the fuzz's time is the token engine and shards decoding chat requests to the end of their
# context: a short context keeps the run within CI's budget. 40 leaves a chat prompt (26 tokens,
# template included) room for a dozen generated tokens.
MAX_MODEL_LEN = 40
CHAT_PROMPT_TOKENS = 26  # "go on {i}" as a one-message chat prompt, template included
CUT_OFF_TOKENS = MAX_MODEL_LEN - CHAT_PROMPT_TOKENS - 4
API_KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeRun]:
    args = {"max_model_len": MAX_MODEL_LEN, "api_key": API_KEY}
    with served("local.yaml", tmp_path_factory.mktemp("serve"), args) as run:
        yield run


def test_fuzzed_api_has_no_server_errors_and_matches_its_schema(
    server: ServeRun, tmp_path: Path
) -> None:
    command = [
        str(SCHEMATHESIS), "run", f"{server.base_url}/openapi.json",
        # Both phases, and bodies that break the schema as well as ones that keep it (`all`,
        # said here so a change of schemathesis's default cannot drop the non-conforming ones).
        "--phases", "coverage,fuzzing", "--mode", "all",
        "--checks", "not_a_server_error,status_code_conformance,response_schema_conformance",
        # One worker: hypothesis parses lambda sources with `ast.parse`, which CPython 3.11 does
        # not allow from two threads at once (SystemError: AST constructor recursion depth
        # mismatch, seen once in CI with --workers 2).
        # 60 examples an operation, beside the coverage phase's cases (most of the count), give
        # over twice MIN_CASES; each example more is a request the mesh decodes on CI's cores.
        "--max-examples", "60", "--seed", "18", "--workers", "1",
        "--request-timeout", "120", "--no-color", "--generation-database", "none",
        "--header", f"Authorization: Bearer {API_KEY}",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=540)
    report = result.stdout + result.stderr
    assert result.returncode == 0, report[-8000:]
    generated = re.search(r"(\d+) generated", report)
    assert generated is not None and int(generated.group(1)) >= MIN_CASES, report[-3000:]

    # The mesh still serves, and holds nothing once the fuzzed requests are done.
    response = httpx.post(f"{server.base_url}/v1/completions", timeout=60, headers=AUTH,
                          json={"prompt": "hello", "max_tokens": 4, "temperature": 0})  # fmt: skip
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    deadline = time.monotonic() + 30
    while (stats := httpx.get(f"{server.base_url}/stats", headers=AUTH).json())["num_requests"] or (
        stats["kv_blocks_used"]
    ):
        assert time.monotonic() < deadline, stats
        time.sleep(0.5)  # frees travel asynchronously: poll another process's state


def test_hostile_chat_bodies_are_4xx_never_5xx(server: ServeRun) -> None:
    """Bodies a deeper schemathesis run found 500s with (its fuzzing phase does not reach them
    at CI's example count), and an 8 MiB chat that cannot fit the context, on the served mesh."""
    headers = AUTH | {"Content-Type": "application/json"}
    huge = {"messages": [{"role": "user", "content": "x" * ((8 << 20) - 100)}]}
    bodies = [*HOSTILE_CHAT_BODIES, json.dumps(huge)]
    for path in ("/v1/chat/completions", "/tokenize"):
        for body in bodies:
            response = httpx.post(f"{server.base_url}{path}", content=body.encode(),
                                  headers=headers, timeout=60)  # fmt: skip
            assert response.status_code in (200, 400, 429), (path, body[:200], response.text)
    # A long assistant turn is no part of the length bound: the chat renders in the router's
    # worker process, and is past the context.
    long = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "word " * 5000}]}  # fmt: skip
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=long, headers=AUTH,
                          timeout=120)  # fmt: skip
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


def test_api_key_is_required_except_for_health_and_metrics(server: ServeRun) -> None:
    body = {"prompt": "hello", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "AuthenticationError"
    assert httpx.get(f"{server.base_url}/v1/models").status_code == 401
    assert httpx.get(f"{server.base_url}/openapi.json").status_code == 401
    assert httpx.get(f"{server.base_url}/openapi.json", headers=AUTH).status_code == 200
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/metrics").status_code == 200  # as vLLM leaves it
    ok = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert ok.status_code == 200


def test_phasemesh_sockets_listen_on_loopback_only(server: ServeRun) -> None:
    """Every IPv4 socket listening in a PhaseMesh replica is on loopback (the config's mesh host):
    ZeroMQ and UCX alike. Ray's own servers in the same processes (its core worker's gRPC, on
    IPv6 any-address) are Ray's to configure and are left out."""
    assert server.pid is not None
    ours = []
    for pid in descendants(server.pid):
        try:
            process = psutil.Process(pid)
            if "ServeReplica:phasemesh:" not in " ".join(process.cmdline()):
                continue
            ours += [
                c.laddr for c in process.net_connections(kind="inet4")
                if c.status == psutil.CONN_LISTEN
            ]  # fmt: skip
        except psutil.Error:
            continue  # exited meanwhile
    # Router inbox 1; per engine 4 ZeroMQ + UCX; per shard 2 ZeroMQ + UCX (deploy/local.yaml).
    assert len(ours) >= 1 + 2 * 4 + 2 * 2 + 2
    assert all(ipaddress.ip_address(addr.ip).is_loopback for addr in ours), ours


def replica_rss(server: ServeRun) -> dict[int, int]:
    assert server.pid is not None
    rss = {}
    for pid in descendants(server.pid):
        try:
            process = psutil.Process(pid)
            if "ServeReplica:phasemesh:" in " ".join(process.cmdline()):
                rss[pid] = process.memory_info().rss
        except psutil.Error:
            continue
    return rss


MAX_RSS_GROWTH = 200 << 20  # per replica, over the soak below


def test_soak_of_mixed_and_hostile_traffic_leaves_everything_idle(server: ServeRun) -> None:
    """Normal, cut-off (the client goes away mid-stream), oversized and hostile requests side
    by side for a while; afterwards the router holds no request, no admission is counted, no
    engine or shard holds KV, and no replica grew by more than `MAX_RSS_GROWTH`."""
    before = replica_rss(server)
    url = server.base_url

    async def normal(http: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": f"soak {i}", "max_tokens": 8, "temperature": 0.7, "seed": i,
                "stop": ["zz"]}  # fmt: skip
        response = await http.post(f"{url}/v1/completions", json=body)
        assert response.status_code == 200, response.text

    async def cut_off(http: httpx.AsyncClient, i: int) -> None:
        # Within the context after the chat prompt (a request that is not gets its 400 instead
        # of being cut off mid-stream), and many steps longer than the client stays.
        body = {"messages": [{"role": "user", "content": f"go on {i}"}], "stream": True,
                "max_tokens": CUT_OFF_TOKENS, "ignore_eos": True}  # fmt: skip
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200, await response.aread()
            async for _ in response.aiter_lines():
                break  # the client leaves after the first event

    async def hostile(http: httpx.AsyncClient, i: int) -> None:
        bodies: list[bytes] = [
            b"x" * (9 << 20),  # over the body limit
            b'{"prompt": "\\ud800", "max_tokens": 2}',
            b'{"prompt": [1, 2], "seed": 18446744073709551616}',
            b'{"messages": [{"role": "user", "content": "<|eot_id|>"}], "max_tokens": 2}',
            b'{"prompt": "hi", "temperature": NaN}',
        ]
        response = await http.post(f"{url}/v1/completions", content=bodies[i % len(bodies)],
                                   headers={"Content-Type": "application/json"})  # fmt: skip
        assert response.status_code in (200, 400, 413), response.text

    async def soak() -> None:
        async with httpx.AsyncClient(headers=AUTH, timeout=120) as http:
            for wave in range(6):
                jobs = [f(http, wave * 8 + i) for i in range(8) for f in (normal, cut_off, hostile)]
                await asyncio.gather(*jobs)

    asyncio.run(soak())
    deadline = time.monotonic() + 60
    while True:
        stats = httpx.get(f"{url}/stats", headers=AUTH, timeout=30).json()
        if not (stats["num_requests"] or stats["num_pending_prompt_tokens"]
                or stats["kv_blocks_used"]):  # fmt: skip
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.5)  # aborts and frees travel asynchronously: poll the services' state
    assert all(s["num_requests"] == 0 for s in stats["services"].values()), stats
    after = replica_rss(server)
    growth = {pid: after[pid] - before[pid] for pid in before if pid in after}
    assert len(growth) >= 5 and max(growth.values()) < MAX_RSS_GROWTH, growth
