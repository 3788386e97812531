"""A token engine under local KV pressure (no shard group, a tiny cache, more hand-offs than it
holds), wired in-process with a real prompt engine (`InProcessPair`: their `on_*` inputs and
`step` outputs, no sockets). Each hand-off starts decoding only once its whole length (prompt +
`max_tokens`) fits beside what the running ones may still grow to; the rest wait, or end alone and
retryably when they cannot fit. Before, every hand-off started at once, the local scheduler
overcommitted its blocks and a step raised `NoFreeBlocksError`, which the worker turns into
`fail_all`: every request on the engine ended (docs/failures.md)."""

from __future__ import annotations

from pathlib import Path

from common.sampling import SamplingParams
from tests.conftest import random_prompts
from tests.unit.test_engine_kv_ingress import InProcessPair, single_process_tokens


def tokens_of(pair: InProcessPair, req_id: str) -> list[int]:
    return [t for o in pair.outputs[req_id] for t in o.token_ids]


def test_hand_offs_that_do_not_fit_wait_or_end_alone(tiny_model_path: Path) -> None:
    # 8 blocks of 16 tokens; each request's whole length is 30 + 40 = 70 tokens (5 blocks), so
    # the cache holds one at a time beside another's landed prompt (2 blocks each), not four.
    prompts = random_prompts([30, 30, 30, 30], vocab=2048, seed=7)
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    pair = InProcessPair(tiny_model_path)
    for i, prompt in enumerate(prompts):
        pair.submit(f"r{i}", prompt, greedy)
    pair.run()  # a step that raised would propagate here (the worker would fail every request)

    finished = [r for r in pair.outputs if pair.outputs[r][-1].finish_reason == "length"]
    ended = [r for r in pair.outputs if pair.outputs[r][-1].error]
    assert sorted(finished + ended) == ["r0", "r1", "r2", "r3"]
    assert finished[:2] == ["r0", "r1"]  # first come, first served: the youngest gave way
    for req_id in ended:
        last = pair.outputs[req_id][-1]
        assert last.retryable and "no room" in last.error, last.error
        assert tokens_of(pair, req_id) == tokens_of(pair, req_id)[:1]  # only its first token
    for req_id in finished:
        i = int(req_id[1:])
        assert tokens_of(pair, req_id) == single_process_tokens(tiny_model_path, prompts[i], greedy)
    assert pair.token.local.num_preemptions == 0  # nothing was started that did not fit
    assert pair.token.blocks.num_used_blocks == 0 and not pair.token.requests
    assert not pair.token.admission.waiting and not pair.token.has_work()
