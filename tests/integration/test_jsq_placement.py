"""JSQ on a real mesh (separate OS processes): the test client places as the router does
(`ClusterScheduler` fed the engines' load reports), and a prompt burst past the prompt pool's
threshold borrows the least-loaded token engine, named, for prefill: the engine itself reports
the mixed pool (`SetRole`), and its own token pool again once its prompts are done; greedy tokens
stay equal. An engine lent with a lease nobody renews goes home by itself."""

from __future__ import annotations

import time
from collections import Counter

from common.engine.core import LLMEngine
from common.protocol import LoadReport, SamplingSpec, SetRole
from common.sampling_params import SamplingParams
from common.scheduling.cluster import PoolThresholds
from services.launch.local_mesh import LocalMesh, Topology
from tests.conftest import random_prompts
from tests.integration.mesh_helpers import assert_no_kv_held
from tests.integration.mesh_test_client import MeshTestClient

LONG_LEN, BURST_LEN, NUM_BURST = 250, 160, 4
# The prompt pool is full past 300 pending tokens: the long prompt fits, and so does the first of
# the burst; the second overflows it.
# The lease is longer than any wait below: t1 can only come home by the router's return.
THRESHOLDS = PoolThresholds(prompt_tokens=300, role_lease_s=300.0)


def test_a_prompt_burst_borrows_the_least_loaded_token_engine(tiny_model_path) -> None:
    mesh = LocalMesh.start(Topology(str(tiny_model_path), num_prompt=1, num_token=2))
    client = MeshTestClient(mesh, THRESHOLDS)
    try:
        (p0,), (t0, t1) = mesh.prompt, mesh.token
        engines = {p0.service_id, t0.service_id, t1.service_id}
        client.wait_for_loads(lambda _: engines <= client.last_reports.keys())
        prompts = random_prompts([LONG_LEN] + [BURST_LEN] * NUM_BURST, 2048, seed=5)
        lengths = [300] + [8] * NUM_BURST
        specs = [SamplingSpec(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]

        # A long request: JSQ ties break to the first engines; t0 now holds its decode.
        client.submit("long", prompts[0], specs[0])
        assert [e.service_id for e in client.placement["long"]] == [p0.service_id, t0.service_id]
        outputs: dict[str, list[int]] = {"long": []}
        first = client.recv(timeout=60)
        outputs[first.req_id] += first.token_ids
        client.wait_for_loads(lambda loads: loads[t0.service_id].decode_tokens >= LONG_LEN
                              and loads[p0.service_id].pending_prompt_tokens == 0)  # fmt: skip

        # The burst, placed faster than the engines report.
        client.refresh()
        for i in range(1, NUM_BURST + 1):
            client.submit(f"burst-{i}", prompts[i], specs[i], refresh=False)
            outputs[f"burst-{i}"] = []
        prefilled_on = {req: pe.service_id for req, (pe, _) in client.placement.items()}
        # burst-1 fits the prompt engine; burst-2 overflows it, and JSQ borrows the token engine
        # least busy with anything: t1 (t0 decodes the long request), never t0.
        assert prefilled_on["burst-1"] == p0.service_id
        assert prefilled_on["burst-2"] == t1.service_id
        assert t0.service_id not in prefilled_on.values()
        # The loan is the engine's state: t1 says it serves in the mixed pool.
        client.wait_for_loads(lambda _: "mixed" in client.roles_seen[t1.service_id])

        done = 0
        while done < len(outputs):
            out = client.recv(timeout=120)
            assert not out.error, out.error
            outputs[out.req_id] += out.token_ids
            done += bool(out.finish_reason)
        reference = LLMEngine.from_path(tiny_model_path, num_blocks=256)
        for i, req_id in enumerate(["long"] + [f"burst-{i}" for i in range(1, NUM_BURST + 1)]):
            params = SamplingParams(max_tokens=lengths[i], temperature=0.0, ignore_eos=True)
            assert outputs[req_id] == reference.generate([prompts[i]], params)[0], req_id
        # Its prompts done, the client (as a router) sends t1 home; t1 reports it.
        client.wait_for_loads(
            lambda _: client.roles_seen[t1.service_id] == ["token", "mixed", "token"]
        )
        assert client.roles_seen[p0.service_id] == ["prompt"]
        # Each engine's reports count the requests it received from this client (as a router):
        # the placements the client re-adds to a report that was made before they arrived.
        placed = Counter(pe.service_id for pe, _ in client.placement.values())
        for engine in engines:
            want = {client.reply_endpoint: placed[engine]} if placed[engine] else {}
            assert client.last_reports[engine].received_requests == want, (engine, placed)
        assert client.roles_seen[t0.service_id] == ["token"]
        assert_no_kv_held(mesh)

        # A loan whose router is gone (no renewal): t0 comes home by itself when it runs out.
        client.push.get(t0.command_endpoint).send(SetRole("mixed", 1.0))
        assert reported_roles(client, t0.service_id, until="token") == ["mixed", "token"]
    finally:
        client.close()
        mesh.close()


def reported_roles(client: MeshTestClient, engine_id: str, until: str) -> list[str]:
    """`engine_id`'s reported pools, read straight off the load reports (no placement, so no
    renewal and no return), from its first `mixed` until it reports `until` again."""
    seen: list[str] = []
    deadline = time.monotonic() + 30
    while not (seen and seen[-1] == until):
        left = deadline - time.monotonic()
        assert left > 0, f"{engine_id} reported {seen}, never back to {until}"
        if not client.load_reports.sock.poll(int(left * 1000)):
            continue
        item = client.load_reports.recv_nowait()
        if item is None or not isinstance(item[1], LoadReport) or item[1].engine_id != engine_id:
            continue
        role = item[1].role
        if (seen or role == "mixed") and (not seen or seen[-1] != role):
            seen.append(role)
    return seen
