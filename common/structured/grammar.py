"""Compiled grammars for one model's tokenizer, and the per-request matcher that walks one.

`GrammarCompiler` owns the llguidance tokenizer (built once per engine from `tokenizer.json`) and
a bounded LRU of compiled grammars keyed by spec. A compiled grammar is an llguidance matcher in
its start state; each request gets a `deep_copy` of it (well under a microsecond), so a schema
that a thousand requests share is compiled once.

`GrammarMatcher` is one request's position in its grammar. It is rebuilt from tokens
(`GrammarCompiler.matcher(spec, token_ids)`), never shipped: a request's sampling moves between
processes (the prompt engine samples the first token, the token engine the rest; a migrated
request re-runs elsewhere from its tokens), and each process replays the tokens so far.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import llguidance
import numpy as np

from common.structured.spec import grammar_for_spec

DEFAULT_CACHE_SIZE = 256  # compiled grammars per engine (each one's lexer grows as it is used)


def mask_words(vocab_size: int) -> int:
    """int32 words in one row of a token bitmask (bit t of the row: token t is allowed)."""
    return (vocab_size + 31) // 32


@dataclass(frozen=True)
class MaskAhead:
    """A matcher's next mask, being filled on another thread (`MaskFiller.prefetch`): row `index`
    of `bitmask` [R, mask_words(vocab)] once `done` is."""

    done: Future[None]
    bitmask: np.ndarray
    index: int

    def wait(self) -> np.ndarray | None:
        """The mask's words once filled; None if the fill failed (the caller fills it again)."""
        try:
            self.done.result()
        except Exception:  # noqa: BLE001 - the row is filled again where it is needed
            return None
        return self.bitmask[self.index]


class GrammarMatcher:
    """One request's grammar state: which tokens may come next, and the tokens so far.

    EOS is allowed only where the text so far is complete (the grammar accepts it); once the
    grammar can take nothing more (`is_terminated`), EOS is the only token allowed. Token ids at
    or past the tokenizer's vocabulary (the model's padding rows) are never allowed.

    Its next mask may be filled ahead, on another thread (`set_ahead`); while that runs, the
    llguidance matcher is borrowed there, so every method here waits for it first (NOTE: touching
    a borrowed matcher raises). The mask stays valid until a token is accepted."""

    def __init__(
        self, matcher: llguidance.LLMatcher, vocab_size: int, eos_token_ids: frozenset[int]
    ) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._ahead: MaskAhead | None = None

    def fill_mask(self, row: np.ndarray) -> None:
        """Write the allowed-token bitmask into `row`: int32, C-contiguous, at least
        `mask_words(vocab_size)` long (words past that are left alone)."""
        words = mask_words(self.vocab_size)
        if row.dtype != np.int32 or not row.flags["C_CONTIGUOUS"] or row.size < words:
            raise ValueError(f"a token bitmask row must be {words} contiguous int32 words")
        ahead = self.mask_ahead()
        if ahead is not None:
            row[:words] = ahead
            return
        # NOTE: llguidance writes through the raw pointer; the checks above are what keep it in
        # bounds.
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, words * 4)

    def mask_ahead(self) -> np.ndarray | None:
        """The next mask's `mask_words(vocab_size)` words if it was filled ahead (waiting for the
        fill to finish), else None."""
        if self._ahead is None:
            return None
        words = self._ahead.wait()
        if words is None:
            self._ahead = None
        return words

    def set_ahead(self, ahead: MaskAhead) -> None:
        """The next mask is being filled by `ahead` (which borrows this matcher until done)."""
        self._wait()
        self._ahead = ahead

    def native(self) -> llguidance.LLMatcher:
        """The llguidance matcher, for a batched fill; free of any fill ahead."""
        self._wait()
        return self._matcher

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it (the matcher is
        then in an error state and the request should fail)."""
        self._wait()
        self._ahead = None  # the mask it filled was for the state this token leaves
        if self._matcher.is_stopped() and token_id in self._eos_token_ids:
            # NOTE: llguidance ends a grammar that can take nothing more by itself and then
            # refuses EOS; the EOS its own mask forced is the one token that may follow.
            return not self._matcher.is_error()
        return bool(self._matcher.consume_token(token_id))

    def is_eos(self, token_id: int) -> bool:
        return token_id in self._eos_token_ids

    def replay(self, token_ids: Iterable[int]) -> bool:
        """Accept tokens one by one (rebuilding a request's state from its output so far);
        False at the first one the grammar refuses."""
        return all(self.accept(token_id) for token_id in token_ids)

    def is_terminated(self) -> bool:
        """Whether the grammar is finished: nothing but EOS may follow."""
        self._wait()
        return bool(self._matcher.is_stopped())

    def is_accepting(self) -> bool:
        """Whether the text so far is a complete match (EOS may come next)."""
        self._wait()
        return bool(self._matcher.is_accepting())

    def error(self) -> str:
        self._wait()
        return str(self._matcher.get_error()) if self._matcher.is_error() else ""

    def _wait(self) -> None:
        """Until a fill ahead is done with the llguidance matcher (its mask is kept)."""
        if self._ahead is not None:
            self._ahead.done.exception()  # waits; a failed fill is refilled where it is needed


class GrammarCompiler:
    """Compiles specs for one tokenizer and hands out matchers; thread-safe.

    `vocab_size` is the model's (its logits' width), which may exceed the tokenizer's."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        eos = sorted(set(eos_token_ids))
        if not eos:
            raise ValueError("structured outputs need at least one EOS token id")
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        if self._tokenizer.vocab_size != vocab_size:
            raise ValueError(
                f"the tokenizer has {self._tokenizer.vocab_size} tokens, more than the model's "
                f"{vocab_size} logits"
            )
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos)
        self._cache_size = cache_size
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        # Specs that did not compile, with why: refused again without compiling them again.
        self._refused: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_model_folder(
        cls, folder: str | Path, vocab_size: int, eos_token_ids: Iterable[int], **kwargs: int
    ) -> GrammarCompiler:
        text = (Path(folder) / "tokenizer.json").read_text()
        return cls(text, vocab_size, eos_token_ids, **kwargs)

    def matcher(self, spec: str, token_ids: Iterable[int] = ()) -> GrammarMatcher:
        """A matcher for `spec` after `token_ids` (a request's output so far). Raises
        ValueError if the spec does not compile or the tokens do not follow it."""
        compiled = self._compiled_for(spec)
        matcher = GrammarMatcher(compiled.deep_copy(), self.vocab_size, self.eos_token_ids)
        if not matcher.replay(token_ids):
            raise ValueError(f"output tokens do not follow the grammar: {matcher.error()[:200]}")
        return matcher

    def cached_specs(self) -> int:
        return len(self._compiled)

    def is_cached(self, spec: str) -> bool:
        """Whether `matcher(spec)` would compile nothing (the spec compiled, or was refused)."""
        with self._lock:
            return spec in self._compiled or spec in self._refused

    def compile(self, spec: str) -> None:
        """Compile `spec` into the cache (a spec that does not compile is remembered as such)."""
        try:
            self._compiled_for(spec)
        except ValueError:
            pass  # `matcher` raises it, from the cache

    def _compiled_for(self, spec: str) -> llguidance.LLMatcher:
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
                return compiled
            refused = self._refused.get(spec)
            if refused is not None:
                raise ValueError(refused)
        # Compiled outside the lock: llguidance releases the GIL while it builds a grammar, and
        # another request's cached grammar should not wait for it. Two threads compiling the same
        # new spec both succeed; the cache keeps one.
        try:
            built = llguidance.LLMatcher(self._tokenizer, grammar_for_spec(spec), log_level=0)
            error = str(built.get_error()) if built.is_error() else ""
        except Exception as exc:  # noqa: BLE001 - a spec that is not one is refused like the rest
            error = str(exc)
        if error:
            why = f"the grammar does not compile: {error[:200]}"
            with self._lock:
                self._refused[spec] = why
                while len(self._refused) > self._cache_size:
                    self._refused.popitem(last=False)
            raise ValueError(why)
        with self._lock:
            self._compiled[spec] = built
            self._compiled.move_to_end(spec)
            while len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
        return built
