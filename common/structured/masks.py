"""Grammar masks applied to a batch of logits: rows without a grammar cost nothing."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from common.structured.grammar import GrammarMatcher, mask_words

_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


def apply_masks(logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None]) -> int:
    """Set every token a row's grammar does not allow to -inf, in place; return the rows masked.

    logits [N, vocab]; `matchers[i]` is row i's matcher, None for a row without a grammar (left
    untouched, not even copied). The masked rows' bitmasks are filled one by one (llguidance,
    microseconds each), then unpacked and applied to all of them in one vectorised pass. Logit
    columns past a matcher's vocabulary (padding) are masked off too."""
    if len(matchers) != logits.shape[0]:
        raise ValueError(f"{len(matchers)} matchers for {logits.shape[0]} rows of logits")
    grammar_rows = [(row, matcher) for row, matcher in enumerate(matchers) if matcher is not None]
    if not grammar_rows:
        return 0
    vocab = logits.shape[-1]
    bitmask = np.zeros((len(grammar_rows), mask_words(vocab)), dtype=np.int32)  # [R, words]
    for k, (_, matcher) in enumerate(grammar_rows):
        if matcher.vocab_size > vocab:
            raise ValueError(f"a grammar over {matcher.vocab_size} tokens, logits over {vocab}")
        matcher.fill_mask(bitmask[k])
    # Bit t of a row (little-endian int32 words, so little-endian bytes) is token t; inverted
    # words unpack straight to the forbidden tokens, padding past a matcher's vocabulary included.
    forbidden = np.unpackbits((~bitmask).view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    forbidden = forbidden.view(np.bool_)  # [R, vocab]
    if logits.device.type == "cpu" and logits.dtype in _NUMPY_DTYPES:
        # NOTE: through numpy, in place: a torch op's dispatch, on a small vocabulary, is most of
        # the mask's cost; the array shares the tensor's memory.
        view = logits.detach().numpy()
        for k, (row, _) in enumerate(grammar_rows):
            np.copyto(view[row], -np.inf, where=forbidden[k])
    else:
        index = torch.tensor([row for row, _ in grammar_rows], device=logits.device)
        masked = logits.index_select(0, index)  # [R, vocab]
        masked.masked_fill_(torch.from_numpy(forbidden).to(logits.device), float("-inf"))
        logits.index_copy_(0, index, masked)
    return len(grammar_rows)
