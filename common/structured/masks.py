"""Grammar masks applied to a batch of logits: rows without a grammar cost nothing.

A step's masks can be filled before its logits exist: once a row's token is accepted, its next
mask depends on its matcher alone. `MaskFiller.prefetch` fills them then, on a thread of its own
and spread over llguidance's (which release the GIL), while the engine streams the step's tokens,
schedules and runs the next forward pass; `apply_masks` then finds them done and only applies
them. A row whose mask was not filled ahead (a new request) is filled in the same batched,
parallel call as the others, not one by one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import llguidance
import numpy as np
import torch

from common.structured.grammar import GrammarMatcher, MaskAhead, mask_words

_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


def default_mask_threads() -> int:
    """llguidance threads per engine: half the cores (the forward pass they overlap needs the
    rest), at least one, at most eight (a step's grammar rows rarely keep more busy)."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


class MaskFiller:
    """Fills a batch's grammar bitmasks with llguidance's parallel executor; thread-safe.

    `fill` gives a step's masks (taking those filled ahead); `prefetch` starts the next step's
    on a background thread. One per engine (its `Sampler` holds it)."""

    def __init__(self, num_threads: int | None = None) -> None:
        self._executor = llguidance.LLExecutor(num_threads or default_mask_threads())
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")

    def fill(self, matchers: Sequence[GrammarMatcher], words: int) -> np.ndarray:
        """[R, words] int32: row k is `matchers[k]`'s mask (zero past its vocabulary's words),
        from its fill ahead where there was one, else filled now, all such rows in one call."""
        bitmask = np.zeros((len(matchers), words), dtype=np.int32)  # [R, words]
        fresh: list[int] = []
        for k, matcher in enumerate(matchers):
            ahead = matcher.mask_ahead()
            if ahead is None:
                fresh.append(k)
            else:
                bitmask[k, : ahead.size] = ahead
        for vocab_size in {matchers[k].vocab_size for k in fresh}:
            rows = [k for k in fresh if matchers[k].vocab_size == vocab_size]
            filled = np.zeros((len(rows), mask_words(vocab_size)), dtype=np.int32)
            self._fill_call([matchers[k].native() for k in rows], filled)()
            bitmask[rows, : filled.shape[1]] = filled
        return bitmask

    def prefetch(self, matchers: Sequence[GrammarMatcher]) -> None:
        """Start filling each matcher's next mask; each one waits for it before it is used."""
        for vocab_size in {m.vocab_size for m in matchers}:
            group = [m for m in matchers if m.vocab_size == vocab_size]
            bitmask = np.zeros((len(group), mask_words(vocab_size)), dtype=np.int32)
            # NOTE: everything but llguidance's own call is done here, not on the thread: what
            # that thread runs in Python holds the GIL the engine's thread needs.
            done = self._thread.submit(self._fill_call([m.native() for m in group], bitmask))
            for k, matcher in enumerate(group):
                matcher.set_ahead(MaskAhead(done, bitmask, k))

    def _fill_call(
        self, natives: list[llguidance.LLMatcher], bitmask: np.ndarray
    ) -> Callable[[], None]:
        """The call that fills row k of `bitmask` [R, words] (int32, C-contiguous) with
        natives[k]'s mask; llguidance releases the GIL while its threads work."""
        rows, words = bitmask.shape
        if not bitmask.flags["C_CONTIGUOUS"] or bitmask.dtype != np.int32 or rows < len(natives):
            raise ValueError("a bitmask must be C-contiguous int32 with a row per matcher")
        # NOTE: llguidance writes through the raw pointer, row k at k * words * 4 bytes: the
        # checks above keep it in bounds, and the call holds `bitmask` so that it outlives the
        # write (a request that ends meanwhile drops its own reference).
        pairs = [(native, k) for k, native in enumerate(natives)]
        pointer, compute = bitmask.ctypes.data, self._executor.unsafe_compute_mask_ptr

        def fill(target: np.ndarray = bitmask) -> None:
            compute(pairs, pointer, words * 4, rows)

        return fill


def apply_masks(
    logits: torch.Tensor,
    matchers: Sequence[GrammarMatcher | None],
    filler: MaskFiller | None = None,
) -> int:
    """Set every token a row's grammar does not allow to -inf, in place; return the rows masked.

    logits [N, vocab]; `matchers[i]` is row i's matcher, None for a row without a grammar (left
    untouched, not even copied). The masked rows' bitmasks come from `filler` (filled ahead, or
    all at once in parallel), or without one are filled one by one; they are then unpacked and
    applied to all rows in one vectorised pass. Logit columns past a matcher's vocabulary
    (padding) are masked off too."""
    if len(matchers) != logits.shape[0]:
        raise ValueError(f"{len(matchers)} matchers for {logits.shape[0]} rows of logits")
    grammar_rows = [(row, matcher) for row, matcher in enumerate(matchers) if matcher is not None]
    if not grammar_rows:
        return 0
    vocab = logits.shape[-1]
    for _, matcher in grammar_rows:
        if matcher.vocab_size > vocab:
            raise ValueError(f"a grammar over {matcher.vocab_size} tokens, logits over {vocab}")
    if filler is not None:
        bitmask = filler.fill([m for _, m in grammar_rows], mask_words(vocab))  # [R, words]
    else:
        bitmask = np.zeros((len(grammar_rows), mask_words(vocab)), dtype=np.int32)
        for k, (_, matcher) in enumerate(grammar_rows):
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
