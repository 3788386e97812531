"""JSQ on a real mesh (separate OS processes): the test client places as the router does
(`ClusterScheduler` fed the engines' load reports), and a prompt burst past the prompt pool's
threshold borrows the least-loaded token engine, named, for prefill; greedy tokens stay equal."""

from __future__ import annotations

from common.engine.core import LLMEngine
from common.protocol import SamplingSpec
from common.sampling import SamplingParams
from common.scheduling.cluster import PoolThresholds
from services.launch.local_mesh import LocalMesh, Topology
from services.launch.test_client import MeshTestClient
from tests.conftest import random_prompts
from tests.integration.mesh_helpers import assert_no_kv_held

LONG_LEN, BURST_LEN, NUM_BURST = 250, 160, 4
# The prompt pool is full past 300 pending tokens: the long prompt fits, and so does the first of
# the burst; the second overflows it.
THRESHOLDS = PoolThresholds(prompt_tokens=300)


def test_a_prompt_burst_borrows_the_least_loaded_token_engine(tiny_model_path) -> None:
    mesh = LocalMesh.start(Topology(str(tiny_model_path), num_prompt=1, num_token=2))
    client = MeshTestClient(mesh, THRESHOLDS)
    try:
        (p0,), (t0, t1) = mesh.prompt, mesh.token
        engines = {p0.service_id, t0.service_id, t1.service_id}
        client.wait_for_loads(lambda _: engines <= client.reported)
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
        assert_no_kv_held(mesh)
    finally:
        client.close()
        mesh.close()
