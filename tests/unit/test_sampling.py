"""Sampling parameters, seeded reproducibility and the finish rules, on the real tiny model."""

from __future__ import annotations

from dataclasses import replace

import pytest

from common.engine.core import LLMEngine
from common.engine.request import FinishReason
from common.protocol import SamplingSpec
from common.sampling_params import SamplingParams
from tests.conftest import random_prompts


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return LLMEngine.from_path(tiny_model_path, num_blocks=128)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"stop": ("",)}, "stop"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"stop": ("END",), "detokenize": False}, "detokenize"),
    ],
)
def test_invalid_parameters_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=rf"invalid sampling parameter {name}\b"):
        SamplingParams(**kwargs)


def run_alone(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    return engine.generate([prompt], params)[0]


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine):
    prompts = random_prompts([12, 30, 7], 2048, seed=11)
    seeded = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    alone = run_alone(engine, prompts[0], seeded)
    other = SamplingParams(max_tokens=24, temperature=1.0, seed=99)
    engine.add_request("a", prompts[0], seeded)
    engine.add_request("b", prompts[1], other)
    engine.add_request("c", prompts[2], other)
    batched: list[int] = []
    while engine.has_unfinished():
        batched += [t for o in engine.step() if o.req_id == "a" for t in o.new_token_ids]
    assert batched == alone
    assert run_alone(engine, prompts[0], SamplingParams(max_tokens=24, seed=4321)) != alone


def test_top_k_one_is_greedy(engine):
    prompt = random_prompts([20], 2048, seed=12)[0]
    greedy = run_alone(engine, prompt, SamplingParams(max_tokens=16, temperature=0.0))
    top1 = run_alone(engine, prompt, SamplingParams(max_tokens=16, temperature=0.7, top_k=1))
    assert top1 == greedy


def test_stop_token_ids_and_max_tokens_finish_requests(engine):
    prompt = random_prompts([15], 2048, seed=13)[0]
    free = run_alone(engine, prompt, SamplingParams(max_tokens=10, temperature=0.0))
    assert len(free) == 10
    stopper = free[4]
    engine.add_request(
        "s", prompt, SamplingParams(max_tokens=10, temperature=0, stop_token_ids=(stopper,))
    )
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].finish_reason is FinishReason.STOP
    assert [o.new_token_ids[0] for o in outs] == free[: free.index(stopper) + 1]


def test_stop_strings_cut_the_text_before_the_stop(engine):
    prompt = random_prompts([15], 2048, seed=14)[0]
    text_params = SamplingParams(max_tokens=20, temperature=0.0)
    engine.add_request("t", prompt, text_params)
    full = ""
    while engine.has_unfinished():
        full += "".join(o.new_text for o in engine.step())
    stop = full[6:9]
    assert stop.strip(), "need a non-trivial stop string"
    engine.add_request("u", prompt, SamplingParams(max_tokens=20, temperature=0.0, stop=(stop,)))
    text, reason = "", None
    while engine.has_unfinished():
        for o in engine.step():
            text, reason = text + o.new_text, o.finish_reason
    assert reason is FinishReason.STOP
    assert text == full[: full.index(stop)]


def test_bad_prompts_are_refused(engine):
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request("e", [], SamplingParams())
    with pytest.raises(ValueError, match="token ids must be in"):
        engine.add_request("v", [5, 99999], SamplingParams())
    with pytest.raises(ValueError, match="context"):
        engine.add_request("l", [5] * engine.max_model_len, SamplingParams())
    assert not engine.has_unfinished()


def test_detokenize_off_gives_the_same_tokens_and_no_text(engine):
    prompt = [5, 17, 300, 42, 9]
    outputs = {}
    for detokenize in (True, False):
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                detokenize=detokenize)  # fmt: skip
        engine.add_request(f"detok-{detokenize}", prompt, params)
        ids, text = [], ""
        while engine.has_unfinished():
            for out in engine.step():
                ids += out.new_token_ids
                text += out.new_text
        outputs[detokenize] = (ids, text)
    assert outputs[False][0] == outputs[True][0]
    assert outputs[False][1] == ""
    assert outputs[True][1] == engine.tokenizer.decode(outputs[True][0])


def test_params_cross_the_wire_with_every_spec_field_and_leave_stop_strings_behind():
    params = SamplingParams(
        max_tokens=9, temperature=0.7, top_p=0.9, top_k=5, seed=3, stop=("x",),
        stop_token_ids=(2, 4), ignore_eos=True, min_tokens=2,
    )  # fmt: skip
    spec = params.to_spec()
    assert spec == SamplingSpec(9, 0.7, 0.9, 5, 3, (2, 4), True, 2)
    assert SamplingParams.from_spec(spec) == replace(params, stop=())  # stops stay at the router
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_spec(SamplingSpec(top_p=0.0))  # validated again on arrival
