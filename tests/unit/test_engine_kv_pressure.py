"""A token engine under local KV pressure (no shard group, a tiny cache, more hand-offs than it
holds), wired in-process with a real prompt engine (`InProcessPair`: their `on_*` inputs and
`step` outputs, no sockets). Each hand-off starts decoding only once its whole length (prompt +
`max_tokens`) fits beside what the running ones may still grow to; the rest wait, or end alone and
retryably when they cannot fit. Before, every hand-off started at once, the local scheduler
overcommitted its blocks and a step raised `NoFreeBlocksError`, which the worker turns into
`fail_all`: every request on the engine ended (docs/failures.md)."""

from __future__ import annotations

import time
from pathlib import Path

from common.config import EngineConfig
from common.engine.core import LLMEngine
from common.mesh_options import MeshOptions
from common.protocol import GenerateRequest
from common.roles import Role
from common.sampling_params import SamplingParams
from services.engine.engine import Engine
from services.engine.faults import EngineFaults
from tests.conftest import random_prompts
from tests.unit.test_engine_kv_ingress import InProcessPair


def single_process_tokens(
    model_path: Path, prompts: list[list[int]], params: SamplingParams
) -> list[list[int]]:
    """What `LLMEngine`, the single-process reference (a cache that holds them all), generates."""
    return LLMEngine(EngineConfig(str(model_path)), with_tokenizer=False).generate(prompts, params)


def tokens_of(pair: InProcessPair, req_id: str) -> list[int]:
    return [t for o in pair.outputs[req_id] for t in o.token_ids]


def test_hand_offs_that_do_not_fit_wait_or_end_alone(tiny_model_path: Path) -> None:
    # 8 blocks of 16 tokens; each request's whole length is 30 + 24 = 54 tokens (4 blocks): the
    # four landed prompts (2 blocks each) fill the cache, which holds two whole requests at most.
    prompts = random_prompts([30, 30, 30, 30], vocab=2048, seed=7)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
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
    expected = single_process_tokens(tiny_model_path, prompts, greedy)
    for req_id in finished:
        assert tokens_of(pair, req_id) == expected[int(req_id[1:])]
    assert pair.token.local.num_preemptions == 0  # nothing was started that did not fit
    assert pair.token.blocks.num_used_blocks == 0 and not pair.token.table.requests
    assert not pair.token.admission.waiting and not pair.token.has_work()


def test_a_mixed_engine_under_kv_pressure_preempts_and_recomputes(tiny_model_path: Path) -> None:
    """Its own prompts decode here and are preempted by recompute when their growth does not
    fit, as the single-process engine does; the tokens are the same. Before, its policy's plan
    counted each admitted prefill without the token it generates, the next prefill took that
    block too, and the step raised `NoFreeBlocksError`."""
    options = MeshOptions(block_size=16, num_blocks=8)
    engine = Engine.build("m", Role.MIXED, options, str(tiny_model_path), lambda *args: None,
                          command_endpoint="m-cmd")  # fmt: skip
    prompts = random_prompts([30, 30, 30, 30], vocab=2048, seed=7)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        message = GenerateRequest(f"r{i}", prompt, greedy.to_spec(), "router", "m-cmd", "")
        engine.on_generate(message)  # decodes here: its token engine is this one, no shards
    for _ in range(1000):
        if not engine.has_work():
            break
        for _, out in engine.step().outputs:
            assert not out.error, out.error
            outputs[out.req_id] += out.token_ids
    assert engine.local.num_preemptions > 0
    expected = single_process_tokens(tiny_model_path, prompts, greedy)
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == expected
    assert engine.blocks.num_used_blocks == 0 and not engine.table.requests


def test_a_waiting_hand_off_starts_once_an_abort_frees_its_room(tiny_model_path: Path) -> None:
    first, second = random_prompts([30, 30], vocab=2048, seed=8)
    greedy = SamplingParams(max_tokens=36, temperature=0.0, ignore_eos=True)  # 66: 5 blocks
    pair = InProcessPair(tiny_model_path)
    pair.submit("first", first, greedy)
    pair.submit("second", second, greedy)
    pair.deliver(pair.prompt.step())
    while pair.kv:
        pair.deliver(pair.token.on_kv(*pair.kv.pop(0)))
    assert [h.req_id for h in pair.token.admission.waiting] == ["second"]  # first may grow
    pair.deliver(pair.token.on_abort("first"))  # its client went away: no step runs after
    pair.deliver(
        EngineFaults(pair.token).expire(time.monotonic())
    )  # the worker's next tick (50 ms)
    assert [s.req_id for s in pair.token.local.running] == ["second"]
    pair.run()
    assert tokens_of(pair, "second") == single_process_tokens(tiny_model_path, [second], greedy)[0]
    assert pair.token.blocks.num_used_blocks == 0 and not pair.token.table.requests
