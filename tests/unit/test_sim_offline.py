"""The simulator's offline mode (loadgen/sim/offline.py) on the A100 profile: the schedule's
transitions, the job's tokens, and the direction of Seesaw's result (§6)."""

from __future__ import annotations

from loadgen.sim.__main__ import main
from loadgen.sim.offline import compare, decode_slots
from loadgen.traces import shared_dir

PROFILE = str(shared_dir() / "perf" / "splitwise_perf_model.csv")


def lengths(n: int) -> list[tuple[int, int]]:
    # Chat-like: 300-1,200 prompt tokens, 20-300 output tokens, deterministic.
    return [(300 + (i * 97) % 900, 20 + (i * 31) % 280) for i in range(n)]


def test_seesaw_transitions_rarely_and_beats_tensor_parallel_alone() -> None:
    job = lengths(600)
    results = compare(job, PROFILE, "a100-80gb", gpus=8, buffer_requests=128)
    total = sum(o for _, o in job)
    assert all(r.num_tokens == total for r in results.values())  # every mode ran the job
    seesaw = results["seesaw"]
    # Transitions only when the buffer fills or empties: about 2 per buffer's worth of requests.
    assert seesaw.num_transitions <= 2 * (600 // 128 + 1)
    assert results["prefill_first"].num_transitions > 10 * seesaw.num_transitions
    # Re-sharding on every switch costs the eager schedule more than it gains.
    assert results["prefill_first"].tokens_per_s < seesaw.tokens_per_s
    # PP prefill + TP decode beats TP alone: prefill pays TP's all-reduces, PP's does not.
    assert seesaw.prefill_s < results["tp"].prefill_s
    assert seesaw.tokens_per_s > results["tp"].tokens_per_s


def test_decode_slots_follow_gpu_memory() -> None:
    assert decode_slots(8, 1000) == 64  # plenty of room: the profiled batch caps it
    assert decode_slots(2, 100_000) == 1  # 20 GB left for KV: one long request at a time


def test_the_cli_prints_a_table_and_json(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["offline", "--requests", "200", "--buffer-requests", "64"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("| mode |") and '"seesaw_over_best_other"' in out[-1]


def test_a_pcie_link_makes_tensor_parallel_decode_dearer_and_leaves_pipeline_alone() -> None:
    from loadgen.sim.offline import ProfileTimes, Sharding

    nvlink, pcie = ProfileTimes(PROFILE, "a100-80gb"), ProfileTimes(PROFILE, "a100-80gb-pcie")
    tp8, pp8 = Sharding(8, 1), Sharding(2, 4)
    # TP8's decode step: 160 all-reduces of the batch's activations over 8 GPUs each step.
    assert pcie.decode_s(tp8, 64) > 1.2 * nvlink.decode_s(tp8, 64)
    assert pcie.prefill_s(tp8, 8192) > 1.5 * nvlink.prefill_s(tp8, 8192)
    # Pipeline stages send one micro-batch's activations and all-reduce over 2 GPUs only.
    assert pcie.decode_s(pp8, 64) < 1.1 * nvlink.decode_s(pp8, 64)
    # On PCIe the TP step loses to the pipeline's; over NVLink it does not by as much.
    ratio = {t: t.decode_s(tp8, 64) / t.decode_s(pp8, 64) for t in (nvlink, pcie)}
    assert ratio[pcie] > ratio[nvlink]
    # Seesaw's gain over the best fixed sharding is larger on PCIe (§6.4's direction).
    job = lengths(300)
    gains = {}
    for hw in ("a100-80gb", "a100-80gb-pcie"):
        results = compare(job, PROFILE, hw, gpus=8, buffer_requests=64)
        best = max(r.tokens_per_s for n, r in results.items() if n != "seesaw")
        gains[hw] = results["seesaw"].tokens_per_s / best
    assert gains["a100-80gb-pcie"] > gains["a100-80gb"] > 1.0
