"""Home roles that follow the queue mix, on a real mesh (separate OS processes): the test client
places as the router does (`ClusterScheduler`, whose `HomeRolePolicy` runs on the engines' load
reports) and sends the `SetRole`s it asks for. A prompt-heavy burst that lasts past the hold moves
a token engine's home toward prompt while it decodes; its running requests finish there with the
single-process engine's greedy tokens, and its home comes back once the burst has ended."""

from __future__ import annotations

import time

import torch

from common.engine.core import LLMEngine
from common.mesh_options import MeshOptions
from common.protocol import SamplingSpec, TokenOutput
from common.roles import Role
from common.sampling_params import SamplingParams
from common.scheduling.cluster import PoolThresholds
from common.scheduling.home_roles import HomeRoleThresholds
from services.launch.local_mesh import LocalMesh, Topology
from tests.conftest import random_prompts
from tests.integration.mesh_helpers import assert_no_kv_held
from tests.integration.mesh_test_client import MeshTestClient

# Two decodes, one per token engine, long enough to outlast the burst until a home moves (a
# short one may finish first on a quiet machine, and the move must come while it runs).
DECODE_LEN, DECODE_TOKENS = 40, 3000
BURST_LEN, MAX_BURST, BURST_STEP = 200, 400, 16  # the burst lasts until a home moves
DRAIN_PER_TURN = 32
# A prompt engine is full at 300 pending tokens: the burst's queue makes the prompt side far
# fuller than the decode side (a few thousand tokens of 32768 of KV each). Short hold and
# cool-down: the move and the move back each come within a second or two.
THRESHOLDS = PoolThresholds(
    prompt_tokens=300, role_lease_s=300.0,
    home_roles=HomeRoleThresholds(shift=0.5, settle=0.1, hold_s=0.4, cooldown_s=1.0),
)  # fmt: skip
GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_a_lasting_prompt_burst_moves_a_decoding_token_engine_home_and_back(
    tiny_model_path,
) -> None:
    # Token engines with room for the burst's hand-offs beside a decode's reservation: this
    # client places without the router's KV admission, and a hand-off the engine has no room
    # for ends retryable (the router would re-run it; here it would fail the test).
    options = MeshOptions(token_num_blocks=2048)
    mesh = LocalMesh.start(
        Topology(str(tiny_model_path), num_prompt=1, num_token=2, options=options)
    )
    client = MeshTestClient(mesh, THRESHOLDS)
    try:
        (p0,), tokens = mesh.prompt, mesh.token
        token_ids = {t.service_id for t in tokens}
        client.wait_for_loads(lambda _: {p0.service_id} | token_ids <= client.last_reports.keys())
        prompts = random_prompts([DECODE_LEN] * 2 + [BURST_LEN] * MAX_BURST, 2048, seed=11)
        lengths = [DECODE_TOKENS] * 2 + [2] * MAX_BURST
        outputs: dict[str, list[int]] = {}
        finished: set[str] = set()

        def take(out: TokenOutput) -> None:
            assert not out.error, out.error
            outputs[out.req_id] += out.token_ids
            if out.finish_reason:
                finished.add(out.req_id)

        # One long decode on each token engine (JSQ puts the second where the first is not).
        for i in range(2):
            client.submit(f"decode-{i}", prompts[i], SamplingSpec(max_tokens=lengths[i], **GREEDY))
            outputs[f"decode-{i}"] = []
        decoding_on = {client.placement[f"decode-{i}"][1].service_id: f"decode-{i}" for i in (0, 1)}
        assert decoding_on.keys() == token_ids
        while min(len(outputs["decode-0"]), len(outputs["decode-1"])) < 3:  # both decoding
            take(client.recv(timeout=60))

        # The burst: prompts kept queued past the prompt pool's fill until a home moves.
        moved, sent = None, 2
        deadline = time.monotonic() + 60

        while moved is None:
            assert time.monotonic() < deadline, "no home moved during a lasting prompt burst"
            loads = client.loads()  # refreshes: the scheduler's policies see the reports
            pending = sum(load.pending_prompt_tokens for load in loads.values())
            # Many at a time: a prefill is short, and the queue must stay full for the hold.
            for _ in range(BURST_STEP if pending < 8 * BURST_LEN else 0):
                if sent == len(prompts):
                    break
                spec = SamplingSpec(max_tokens=lengths[sent], **GREEDY)
                client.submit(f"burst-{sent}", prompts[sent], spec, refresh=False)
                outputs[f"burst-{sent}"] = []
                sent += 1
            # A bounded share of the decodes' tokens per turn (blocking a little: no busy loop):
            # draining them all would starve the burst, and its queue would empty.
            for _ in range(DRAIN_PER_TURN):
                if (out := poll(client, 0.005)) is None:
                    break
                take(out)
            moved = next((t for t in token_ids
                          if client.last_reports[t].home_role != Role.TOKEN), None)  # fmt: skip
        # The engine moved while it decoded: the report that says so counts its running request.
        report = client.last_reports[moved]
        assert report.home_role in (Role.MIXED, Role.PROMPT)
        assert report.num_running >= 1 and decoding_on[moved] not in finished

        # The burst over, every request finishes.
        deadline = time.monotonic() + 120
        while len(finished) < sent:
            assert time.monotonic() < deadline, f"unfinished: {set(outputs) - finished}"
            client.refresh()  # the policy keeps sampling: the mix settles
            out = poll(client, 0.2)
            if out is not None:
                take(out)
        # Settled: the homes go back, one step per cool-down, to the ones deployed.
        client.wait_for_loads(lambda _: all(client.last_reports[t].home_role == Role.TOKEN
                                            for t in token_ids), timeout=60)  # fmt: skip
        stats = {s.service_id: s for s in mesh.stats()}
        assert stats[moved].num_home_moves >= 2 and stats[moved].home_role == Role.TOKEN
        assert stats[p0.service_id].num_home_moves == 0
        assert_no_kv_held(mesh)
        # Each request's tokens are the single-process engine's (the moved engine's decode
        # among them: it finished where it ran, with no re-run).
        reference = LLMEngine.from_path(tiny_model_path, num_blocks=256)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # NOTE: a tiny model's threads only wait on a busy machine
        try:
            for lo, hi in ((0, 2), (2, sent)):  # one batch per max_tokens
                params = SamplingParams(max_tokens=lengths[lo], **GREEDY)
                want = reference.generate(prompts[lo:hi], params)
                for i, tokens in zip(range(lo, hi), want, strict=True):
                    req_id = f"decode-{i}" if i < 2 else f"burst-{i}"
                    assert outputs[req_id] == tokens, req_id
        finally:
            torch.set_num_threads(threads)
    finally:
        client.close()
        mesh.close()


def poll(client: MeshTestClient, timeout: float) -> TokenOutput | None:
    """The next token message if one comes within `timeout` s, else None."""
    try:
        return client.recv(timeout)
    except TimeoutError:
        return None
