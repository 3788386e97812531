"""Grammar masks filled ahead and in parallel (`MaskFiller`), against the one-by-one fill.

The reference is the per-row fill of a matcher rebuilt from the same tokens (`replay`), which
shares nothing with the batched executor or the fill ahead; sampling greedily through the
`Sampler` (masks filled ahead) must pick the tokens that the one-by-one path picks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.sampling import Sampler
from common.sampling_params import SamplingParams
from common.structured.grammar import GrammarMatcher, mask_words
from common.structured.masks import MaskFiller, apply_masks
from tests.unit.json_schemas import SCHEMAS
from tests.unit.test_structured_output import compiler, json_schema_spec, structure_bias

BATCH = 6
STEPS = 40


def specs() -> list[str]:
    names = sorted(SCHEMAS)[:BATCH]
    return [json_schema_spec(SCHEMAS[name]) for name in names]


def reference_mask(spec: str, token_ids: list[int], words: int) -> np.ndarray:
    """The mask after `token_ids`, from a fresh matcher filled one row at a time."""
    row = np.zeros(words, dtype=np.int32)
    compiler().matcher(spec, token_ids).fill_mask(row)
    return row


def test_sampler_fills_the_next_masks_ahead_and_they_are_the_reference() -> None:
    """After each step every grammar row that goes on already has its next mask (filled while
    the engine would run its next forward pass), equal to a freshly filled one; greedy tokens
    are those of the one-by-one path."""
    vocab, words = compiler().vocab_size, mask_words(compiler().vocab_size)
    all_specs = specs()
    sampler = Sampler()
    matchers: list[GrammarMatcher | None] = [compiler().matcher(s) for s in all_specs]
    plain = [compiler().matcher(s) for s in all_specs]  # the one-by-one path's own matchers
    params = [SamplingParams(max_tokens=10**6, temperature=0.0)] * BATCH
    tokens: list[list[int]] = [[] for _ in range(BATCH)]
    gen = torch.Generator().manual_seed(3)
    for step in range(STEPS):
        logits = torch.randn(BATCH, vocab, generator=gen) + structure_bias()  # [B, vocab]
        reference = logits.clone()
        apply_masks(reference, plain)  # no filler: each row filled alone, on this thread
        expected = reference.argmax(dim=-1).tolist()
        out = sampler.sample(logits, params, [step] * BATCH, grammars=matchers)
        assert out.token_ids == expected and not out.failures
        for row, matcher in enumerate(matchers):
            assert matcher is not None and plain[row].accept(expected[row])
            tokens[row].append(expected[row])
            if matcher.is_eos(expected[row]):
                continue
            ahead = matcher.mask_ahead()
            assert ahead is not None, f"row {row}'s next mask was not filled ahead"
            assert np.array_equal(ahead, reference_mask(all_specs[row], tokens[row], words))
        ended = [row for row in range(BATCH) if matchers[row].is_terminated()]  # type: ignore[union-attr]
        for row in ended:  # a finished row starts its schema again
            matchers[row], plain[row] = (compiler().matcher(all_specs[row]) for _ in range(2))
            tokens[row] = []


def test_parallel_fill_matches_one_by_one_with_mixed_ahead_rows() -> None:
    """A batch where some rows were filled ahead and some were not (new requests), over logits
    wider than the tokenizer (padding columns), masks exactly as the one-by-one fill does."""
    filler = MaskFiller(num_threads=2)
    all_specs = specs()
    prefix = compiler().matcher(all_specs[0])
    steps = []
    for _ in range(5):  # a few tokens into the first schema, for a state that is not the start
        row = np.zeros(mask_words(compiler().vocab_size), dtype=np.int32)
        prefix.fill_mask(row)
        allowed = np.unpackbits(row.view(np.uint8), bitorder="little").nonzero()[0]
        steps.append(int(allowed[len(allowed) // 2]))
        assert prefix.accept(steps[-1])
    ahead = [compiler().matcher(all_specs[0], steps), compiler().matcher(all_specs[1])]
    filler.prefetch(ahead)
    fresh = [compiler().matcher(s) for s in all_specs[2:]]
    batch: list[GrammarMatcher | None] = [ahead[0], None, fresh[0], ahead[1], *fresh[1:]]
    vocab = compiler().vocab_size + 24
    logits = torch.randn(len(batch), vocab, generator=torch.Generator().manual_seed(0))
    expected = logits.clone()
    references: list[GrammarMatcher | None] = [
        None if m is None else compiler().matcher(s, t)
        for m, s, t in zip(
            batch,
            [all_specs[0], "", all_specs[2], all_specs[1], *all_specs[3:]],
            [steps, [], [], [], *([[]] * len(fresh[1:]))],
            strict=True,
        )
    ]
    apply_masks(expected, references)
    assert apply_masks(logits, batch, filler) == len(batch) - 1
    assert torch.equal(logits, expected)
    masked = [row for row, m in enumerate(batch) if m is not None]
    assert torch.isinf(logits[masked, compiler().vocab_size :]).all()  # padding columns


@pytest.mark.parametrize("num_threads", [1, 3])
def test_reading_a_matcher_waits_for_its_fill_ahead(num_threads: int) -> None:
    """A matcher is borrowed while its mask is filled ahead: every method waits instead of
    touching it (llguidance raises on a borrowed matcher)."""
    filler = MaskFiller(num_threads=num_threads)
    matchers = [compiler().matcher(s) for s in specs() for _ in range(4)]
    for _ in range(20):
        filler.prefetch(matchers)
        for matcher in matchers:
            assert not matcher.is_terminated() and matcher.error() == ""
            assert matcher.mask_ahead() is not None
