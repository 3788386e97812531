"""The Sampler's logits processors against a plain per-request reference of the published formulas.

The reference is written the obvious way, one request and one token at a time, from OpenAI's
documentation (frequency/presence penalties over generated tokens), Hugging Face's
`RepetitionPenaltyLogitsProcessor` (prompt and generated tokens; positive logits divided,
negative multiplied), vLLM's `min_p` (drop tokens below min_p * the top probability at the row's
temperature) and `logit_bias` (added). The Sampler does the same batched; both run on the same
random logits, in batches that mix every processor with plain rows.
"""

from __future__ import annotations

import math
from collections import Counter

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import common.sampling
from common.logits_processors import History
from common.sampling import Sampler
from common.sampling_params import SamplingParams

VOCAB = 48


def reference_logits(logits: list[float], p: SamplingParams, history: History) -> list[float]:
    """One request's processed logits, token by token (the formulas as published)."""
    prompt_ids, output_ids = history
    out = list(logits)
    for token_id, bias in p.logit_bias:
        out[token_id] += bias
    counts = Counter(output_ids)
    seen = set(prompt_ids) | set(output_ids)
    for t in range(len(out)):
        if t in seen:
            rp = p.repetition_penalty
            out[t] = out[t] / rp if out[t] > 0 else out[t] * rp
        out[t] -= p.frequency_penalty * counts[t] + p.presence_penalty * (counts[t] > 0)
    return out


def reference_min_p_kept(logits: list[float], p: SamplingParams) -> set[int]:
    scaled = [x / p.temperature for x in logits]
    top = max(scaled)
    probs = [math.exp(x - top) for x in scaled]
    total = sum(probs)
    return {t for t, q in enumerate(probs) if q / total >= p.min_p * max(probs) / total}


penalty = st.one_of(st.just(0.0), st.floats(-2.0, 2.0))
processed_params = st.builds(
    SamplingParams,
    temperature=st.just(0.0),
    presence_penalty=penalty,
    frequency_penalty=penalty,
    repetition_penalty=st.one_of(st.just(1.0), st.floats(0.1, 3.0)),
    logit_bias=st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=6).map(
        lambda d: tuple(sorted(d.items()))
    ),
)
plain_params = st.just(SamplingParams(temperature=0.0))
token_lists = st.lists(st.integers(0, VOCAB - 1), max_size=12)


@settings(max_examples=150, deadline=None)
@given(
    params=st.lists(st.one_of(processed_params, plain_params), min_size=1, max_size=6),
    histories=st.lists(st.tuples(token_lists, token_lists), min_size=6, max_size=6),
    seed=st.integers(0, 2**31),
)
def test_processed_logits_and_greedy_tokens_match_the_reference(
    params: list[SamplingParams], histories: list[History], seed: int
) -> None:
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(seed)) * 4
    histories = histories[: len(params)]
    failures: dict[int, Exception] = {}
    processed = Sampler()._process(logits, params, histories, None, [None] * len(params), failures)
    out = Sampler().sample(logits, params, [len(h[1]) for h in histories], histories)
    assert failures == {} and out.failures == {}
    for row, p in enumerate(params):
        expected = torch.tensor(reference_logits(logits[row].tolist(), p, histories[row]))
        torch.testing.assert_close(processed[row], expected, rtol=1e-5, atol=1e-4)
        best = float(expected.max())
        # Greedy picks the reference's top token (any of them on a float near-tie).
        assert float(expected[out.token_ids[row]]) >= best - 1e-4
        if not p.has_processors:  # plain rows: exactly the unprocessed argmax
            assert out.token_ids[row] == int(logits[row].argmax())


@settings(max_examples=100, deadline=None)
@given(
    min_p=st.floats(0.0, 1.0),
    temperature=st.floats(0.05, 2.0),
    seed=st.integers(0, 2**31),
)
def test_min_p_keeps_exactly_the_reference_tokens(
    min_p: float, temperature: float, seed: int
) -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    p = SamplingParams(temperature=temperature, min_p=min_p, seed=1)
    params = [SamplingParams(temperature=0.0), p, SamplingParams(temperature=1.0, seed=2)]
    masked = Sampler()._apply_min_p(logits, params, [1, 2])
    kept = {t for t in range(VOCAB) if math.isfinite(float(masked[1, t]))}
    expected = reference_min_p_kept(logits[1].tolist(), p)
    # Float rounding may only move tokens sitting right on the threshold.
    probs = torch.softmax(logits[1] / temperature, -1)
    threshold = min_p * float(probs.max())
    for t in kept ^ expected:
        assert abs(float(probs[t]) - threshold) <= 1e-6 * max(threshold, 1e-30)
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])  # rows without min_p untouched
    draws = {Sampler().sample(logits, params, [i, i, i]).token_ids[1] for i in range(30)}
    assert draws <= kept


def test_plain_rows_keep_their_tokens_beside_penalised_ones() -> None:
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(3)) * 5
    plain = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=11)] * 3
    mixed = list(plain)
    mixed[1] = SamplingParams(temperature=0.9, seed=11, frequency_penalty=2.0, min_p=0.2)
    mixed[4] = SamplingParams(temperature=0.0, logit_bias=((7, 100.0),), repetition_penalty=2.0)
    histories: list[History] = [([1, 2], [3, 3, 4])] * 6
    alone = Sampler().sample(logits, plain, [5] * 6, histories).token_ids
    together = Sampler().sample(logits, mixed, [5] * 6, histories).token_ids
    assert [together[i] for i in (0, 2, 3, 5)] == [alone[i] for i in (0, 2, 3, 5)]
    assert together[4] == 7  # a +100 bias wins


def test_the_plain_path_does_not_copy_the_logits() -> None:
    logits = torch.randn(4, VOCAB)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1)] * 2
    assert Sampler()._process(logits, params, None, None, [None] * len(params), {}) is logits


def test_a_row_whose_processor_raises_fails_alone(monkeypatch) -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(5)) * 3
    params = [
        SamplingParams(temperature=0.0, presence_penalty=1.0),
        SamplingParams(temperature=0.0, presence_penalty=1.5, seed=666),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logit_bias=((3, 50.0),)),
    ]
    histories: list[History] = [([1], [2, 2])] * 4
    others = [params[i] for i in (0, 2, 3)]
    clean = Sampler().sample(logits[[0, 2, 3]], others, [2] * 3, histories[:3]).token_ids
    real = common.sampling.apply_penalties

    def poisoned(logits, params, histories):  # a stand-in for any per-request processor fault
        if any(p.seed == 666 for p in params):
            raise FloatingPointError("poisoned row")
        return real(logits, params, histories)

    monkeypatch.setattr(common.sampling, "apply_penalties", poisoned)
    out = Sampler().sample(logits, params, [2] * 4, histories)
    assert list(out.failures) == [1] and "poisoned" in str(out.failures[1])
    assert [out.token_ids[i] for i in (0, 2, 3)] == clean


def test_a_bias_past_the_vocabulary_fails_its_row_alone() -> None:
    logits = torch.randn(2, VOCAB)
    params = [SamplingParams(temperature=0.0, logit_bias=((VOCAB, 1.0),)),
              SamplingParams(temperature=0.0)]  # fmt: skip
    out = Sampler().sample(logits, params, [0, 0], [([1], []), ([1], [])])
    assert list(out.failures) == [0] and "logit_bias" in str(out.failures[0])
    assert out.token_ids[1] == int(logits[1].argmax())


def test_logprobs_are_the_raw_models_and_seeded_draws_stay_reproducible() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(9)) * 2
    logits[2] = logits[0]  # the same request twice in one batch
    p = SamplingParams(temperature=0.8, seed=21, logprobs=5, presence_penalty=1.0,
                       logit_bias=((4, 3.0),))  # fmt: skip
    params = [p, SamplingParams(temperature=0.0), p]
    histories: list[History] = [([1], [4, 4])] * 3
    first = Sampler().sample(logits, params, [2, 2, 2], histories)
    again = Sampler().sample(logits[:1], [p], [2], histories[:1])
    assert first.token_ids[0] == first.token_ids[2] == again.token_ids[0]
    raw = torch.log_softmax(logits[0], -1)  # of the model's logits, before bias and penalties
    lp = first.logprobs[0]
    assert lp is not None and first.logprobs[1] is None
    assert math.isclose(lp.logprob, float(raw[first.token_ids[0]]), abs_tol=1e-5)
    top = raw.topk(5)
    assert list(lp.top_ids) == top.indices.tolist()
    torch.testing.assert_close(torch.tensor(lp.top_logprobs), top.values)


def test_an_allowed_mask_limits_every_row_to_its_tokens() -> None:
    # The hook structured output will use: one bool row per request, applied before the draw.
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(4))
    allowed = torch.zeros(3, VOCAB, dtype=torch.bool)
    allowed[0, [5, 9]] = True
    allowed[1, 30] = True
    allowed[2] = True
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3),
              SamplingParams(temperature=0.0)]  # fmt: skip
    out = Sampler().sample(logits, params, [0, 0, 0], allowed_mask=allowed)
    assert out.token_ids[0] == (5 if logits[0, 5] >= logits[0, 9] else 9)
    assert out.token_ids[1] == 30 and out.token_ids[2] == int(logits[2].argmax())


def test_allowed_token_ids_and_bad_words_in_a_mixed_batch() -> None:
    """vLLM's meanings: `allowed_token_ids` leaves only those ids; a bad word's last token is
    banned where the output ends with the rest of it (a one-token word always); rows without
    either are untouched, and the fields cross the wire."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(7))
    params = [
        SamplingParams(allowed_token_ids=(3, 9)),
        SamplingParams(bad_words=((5,), (1, 2, 7), (4, 8))),
        SamplingParams(),
    ]
    histories = [([1], []), ([0], [6, 1, 2]), ([0], [])]
    out = Sampler().sample(logits, params, [0, 3, 0], histories)
    assert out.token_ids[0] in (3, 9) and not out.failures
    processed = Sampler()._process(logits, params, histories, None, [None] * 3, {})
    assert torch.isinf(processed[0]).sum() == VOCAB - 2
    assert math.isinf(processed[1, 5]) and math.isinf(processed[1, 7])  # (1, 2) ends the output
    assert not math.isinf(processed[1, 8])  # the output does not end with 4
    assert torch.equal(processed[2], logits[2])
    for p in params:
        assert SamplingParams.from_spec(p.to_spec()) == p
