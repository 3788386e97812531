"""Several greedy decode iterations in one call (`num_scheduler_steps`: `LLMEngine._step_greedy`,
`EngineScheduler.extend_decode`, `FusedDecode.run_greedy`, csrc `decode_greedy`): the tokens,
text and finish reasons of single steps, whatever ends a request mid-call; single steps wherever
a row needs more than the argmax or anything else waits; bad inputs refused before any write."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.dlpack import to_dlpack

from common.config import SchedulerConfig
from common.engine.core import LLMEngine
from common.engine.request import FinishReason
from common.model import fused_decode
from common.model.linear import pack_linears
from common.sampling_params import SamplingParams
from common.scheduling.batching import Phase
from tests.kernel_gate import kernel_gate

pytestmark = kernel_gate(
    "csrc extension without greedy decode steps", built=hasattr(fused_decode._EXT, "decode_greedy")
)

STEPS = 8


def _engines(path, num_blocks: int = 128) -> tuple[LLMEngine, LLMEngine]:  # type: ignore[no-untyped-def]
    """The same model twice: single steps, and up to STEPS steps a call."""
    return (
        LLMEngine.from_path(path, num_blocks=num_blocks),
        LLMEngine.from_path(path, num_blocks=num_blocks, num_scheduler_steps=STEPS),
    )


def _prompts(vocab: int, count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 40))] for _ in range(count)]


def _run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """Every output of every step, per request: tokens, text, finish reason; and how many
    tokens each step gave each request."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    text = dict.fromkeys(tokens, "")
    reasons: dict[str, FinishReason | None] = {}
    per_output: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.req_id] += out.new_token_ids
            text[out.req_id] += out.new_text
            per_output.append(len(out.new_token_ids))
            if out.finished:
                reasons[out.req_id] = out.finish_reason
                assert out.num_output_tokens == len(tokens[out.req_id])
    return {"tokens": tokens, "text": text, "reasons": reasons, "per_output": per_output}


def _greedy(max_tokens: int, **kw) -> SamplingParams:  # type: ignore[no-untyped-def]
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


@pytest.mark.parametrize("weight_dtype", ["float32", "int8"])
def test_greedy_steps_give_the_single_steps_tokens(tiny_model_path, weight_dtype):
    """Mixed prompt lengths and max_tokens that end mid-call (1, 2, 7, 9, 30): every request's
    tokens and finish reason are the single-step engine's, and calls did give several tokens."""
    one, many = _engines(tiny_model_path)
    for engine in (one, many):
        pack_linears(engine.model, weight_dtype=weight_dtype)
    prompts = _prompts(one.model_config.vocab_size, 5)
    params = [_greedy(n, ignore_eos=True, detokenize=False) for n in (1, 2, 7, 9, 30)]
    single, stepped = _run(one, prompts, params), _run(many, prompts, params)
    assert stepped["tokens"] == single["tokens"]
    assert [len(t) for t in stepped["tokens"].values()] == [1, 2, 7, 9, 30]
    assert stepped["reasons"] == single["reasons"]
    assert max(stepped["per_output"]) == STEPS and max(single["per_output"]) == 1


def test_a_stop_token_or_string_mid_call_ends_the_request_there(tiny_model_path):
    """A stop token id that greedy decoding reaches mid-call, and a stop string: the request
    ends at the same token with the same text as single steps; the steps after it are dropped
    (its blocks freed with it)."""
    one, many = _engines(tiny_model_path)
    prompts = _prompts(one.model_config.vocab_size, 2, seed=1)
    free = many.blocks.num_free_blocks
    probe = _run(one, prompts, [_greedy(20, ignore_eos=True)] * 2)
    stop_token = probe["tokens"]["0"][5]  # the sixth token: inside the first call of STEPS
    text = probe["text"]["1"]
    stop_text = text[len(text) // 3 : len(text) // 3 + 4]  # four characters from the middle
    params = [_greedy(20, ignore_eos=True, stop_token_ids=[stop_token]),
              _greedy(20, ignore_eos=True, stop=[stop_text])]  # fmt: skip
    one2, _ = _engines(tiny_model_path)
    single, stepped = _run(one2, prompts, params), _run(many, prompts, params)
    assert stepped == {**single, "per_output": stepped["per_output"]}
    assert single["tokens"]["0"][-1] == stop_token and len(single["tokens"]["0"]) <= 6
    assert stepped["reasons"] == {"0": FinishReason.STOP, "1": FinishReason.STOP}
    assert stop_text not in stepped["text"]["1"] and len(stepped["tokens"]["1"]) < 20
    assert many.blocks.num_free_blocks == free and not many.requests


def test_rows_that_need_the_logits_and_waiting_prompts_take_single_steps(tiny_model_path):
    """A batch with a row that samples, wants logprobs or has a bias decodes one step a call;
    so does any batch while a prompt waits for its prefill: a new request is prefilled at the
    next call, never after STEPS iterations of the others."""
    _, many = _engines(tiny_model_path)
    vocab = many.model_config.vocab_size
    prompts = _prompts(vocab, 2, seed=2)
    for other in (
        SamplingParams(max_tokens=12, temperature=0.8, seed=1),
        _greedy(12, logprobs=2),
        _greedy(12, logit_bias=[(5, 1.0)]),
    ):
        run = _run(many, prompts, [_greedy(12, ignore_eos=True), other])
        assert max(run["per_output"]) == 1, other
    many.add_request("a", prompts[0], _greedy(40, ignore_eos=True))
    many.step()  # its prefill
    assert len(many.step()[0].new_token_ids) == STEPS
    many.add_request("b", prompts[1], _greedy(40, ignore_eos=True))
    outputs = many.step()
    assert [o.req_id for o in outputs] == ["b"]  # its prefill came first...
    assert len(many.step()[0].new_token_ids) == 1  # ...and its first decode joined "a"'s
    assert len(many.step()[0].new_token_ids) == STEPS  # then both run STEPS a call


def test_greedy_steps_stop_at_the_blocks_and_preemptions_keep_the_tokens(tiny_model_path):
    """A cache too small for every request's whole length: calls run only as many iterations as
    the free blocks hold, preemption and recompute happen as with single steps, and every
    request's tokens are the single-step engine's."""
    one, many = _engines(tiny_model_path, num_blocks=10)
    prompts = _prompts(one.model_config.vocab_size, 3, seed=3)
    params = [_greedy(60, ignore_eos=True, detokenize=False) for _ in prompts]
    single, stepped = _run(one, prompts, params), _run(many, prompts, params)
    assert stepped["tokens"] == single["tokens"]
    assert many.scheduler.num_preemptions > 0
    assert many.blocks.num_free_blocks == many.blocks.num_blocks


def test_extend_decode_commits_only_what_the_blocks_hold(tiny_model_path):
    """`extend_decode`: none for a prefill, for fewer rows than are running or while a prompt
    waits; otherwise the iterations asked for, or as many as the free blocks hold, each grown
    into its blocks; `update` then counts them."""
    engine = LLMEngine.from_path(tiny_model_path, num_blocks=6, block_size=16)
    sched = engine.scheduler
    engine.add_request("a", [5] * 20, _greedy(200, ignore_eos=True))
    prefill = sched.schedule()
    assert prefill is not None and prefill.phase is Phase.PREFILL
    assert sched.extend_decode(prefill, 4) == 1
    sched.update(prefill, set())
    decode = sched.schedule()
    assert decode is not None and decode.phase is Phase.DECODE
    assert sched.extend_decode(decode, 1) == 1
    assert sched.extend_decode(decode, 4) == 4
    assert len(engine.blocks.block_table("a")) == 2  # tokens 0-23 (the 21st's input and 3 more)
    sched.update(decode, set(), 4)
    seq = sched.seqs["a"]
    assert (seq.num_tokens, seq.num_computed) == (25, 24)
    decode = sched.schedule()
    assert decode is not None
    # 4 blocks free: 64 more tokens (the policy's lower bound, whole blocks) after this one's.
    assert sched.extend_decode(decode, 200) == 65
    assert engine.blocks.num_free_blocks == 0
    engine.add_request("b", [6] * 3, _greedy(4))
    sched.update(decode, set(), 65)
    assert sched.extend_decode(decode, 4) == 1  # "b" waits for its prefill


def test_bad_steps_raise_before_any_write(tiny_model_path):
    """A position outside the RoPE tables, a slot outside the cache, a token id outside the
    embedding, shapes that disagree: ValueError, and the KV cache is untouched. A block id
    outside the cache is found as attention reads it, as in one step: ValueError too (the
    engine's step then fails as a single step's would)."""
    engine = LLMEngine.from_path(tiny_model_path, num_blocks=8)
    engine.generate([[5, 6, 7]], _greedy(2))  # builds the fused layers
    fused = engine.runner._fused
    assert fused is not None and fused.greedy
    key = engine.runner.kv_cache.key.clone()
    ids = torch.tensor([5, 6])
    pos = torch.tensor([[3, 4], [4, 5]])
    slots = torch.tensor([[3, 20], [4, 21]])
    tables = torch.tensor([[0], [1]], dtype=torch.int32)
    lens = (pos + 1).to(torch.int32)
    max_pos = engine.model_config.max_position_embeddings
    with pytest.raises(ValueError, match="position"):
        fused.run_greedy(ids, pos + max_pos, slots, tables, lens)
    with pytest.raises(ValueError, match="slot"):
        fused.run_greedy(ids, pos, slots + 8 * 16, tables, lens)
    with pytest.raises(ValueError, match="token id"):
        fused.run_greedy(ids + engine.model_config.vocab_size, pos, slots, tables, lens)
    with pytest.raises(ValueError, match="context_lens"):
        fused.run_greedy(ids, pos, slots, tables, lens[:1])
    assert torch.equal(engine.runner.kv_cache.key, key)
    with pytest.raises(ValueError, match="block id"):  # checked as attention reads: mid-call
        fused.run_greedy(ids, pos, slots, tables + 8, lens)
    tokens = fused.run_greedy(ids, pos, slots, tables, lens)
    assert tokens.shape == (2, 2) and tokens.dtype == torch.int64


def _argmax_rows() -> torch.Tensor:
    """Rows whose argmax is easy to get wrong: ties (the first wins), -0 against +0, infinities,
    NaNs (the first NaN wins, as numpy's), a maximum in the first and the last element, lengths
    that are no multiple of any ISA's lanes."""
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(12, 203, generator=gen)
    rows[1, [7, 150]] = 9.0  # a tie: 7
    rows[2] = -1.0
    rows[2, [30, 31]] = torch.tensor([-0.0, 0.0])  # the first of the two zeros: 30
    rows[3, 190] = float("inf")
    rows[4, [5, 100]] = float("nan")  # 5
    rows[5, 180] = float("nan")
    rows[5, 3] = float("inf")  # a NaN after the maximum: still the NaN
    rows[6, 0] = 50.0
    rows[7, 202] = 50.0
    rows[8] = float("-inf")  # all equal: 0
    rows[9] = float("nan")
    return rows


def test_the_argmax_is_numpys_on_every_isa():
    """`first_argmax` (what `decode_greedy` takes its tokens from) against numpy's argmax, which
    the sampler's greedy rows take, on every ISA this CPU runs, at row lengths from 1 up."""
    from common.attention.cpu_kernel import supported_isas

    ext = fused_decode._EXT
    rows = _argmax_rows()
    for isa in supported_isas():
        for n in (1, 3, 4, 15, 16, 17, 64, 203):
            part = rows[:, :n].contiguous()
            got = ext.first_argmax(to_dlpack(part), isa)
            assert got == part.numpy().argmax(axis=-1).tolist(), (isa, n)


def test_num_scheduler_steps_below_one_is_refused():
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        SchedulerConfig(num_scheduler_steps=0)
