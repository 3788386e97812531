"""Token-id prompts of an exact length, with Mooncake hash_ids reproduced as shared prefixes.

The OpenAI completions API takes `prompt` as a list of token ids, so a prompt of exactly
`input_len` tokens needs no tokenizer and survives no re-encoding drift. Each hash id maps to one
fixed block of `block_len` ids (seeded by the run seed and the id), so two requests whose
hash_ids agree on a prefix send identical token prefixes, which a prefix-aware router or KV cache
can reuse. Tokens past the hash blocks (and all tokens of traces without hash_ids, like Azure)
are unique to the request, so no prefix is shared by accident.
"""

from __future__ import annotations

import functools

import numpy as np

from loadgen.target import RequestSpec

_BLOCK_STREAM = 1  # rng stream tags keep block ids and per-request tails independent
_TAIL_STREAM = 2


class PromptBuilder:
    """Builds prompt token ids for a `RequestSpec`; deterministic for a given seed and vocab."""

    def __init__(
        self, vocab_size: int = 32000, seed: int = 0, cache_blocks: int = 4096,
        low_id: int | None = None,
    ) -> None:  # fmt: skip
        if vocab_size < 8:
            raise ValueError(f"vocab_size too small: {vocab_size}")
        self.vocab_size = vocab_size
        self.seed = seed
        # NOTE: skip the lowest ids, where tokenizers put BOS/EOS/PAD and other specials.
        self.low_id = min(256, vocab_size // 4) if low_id is None else low_id
        self._block = functools.lru_cache(maxsize=cache_blocks)(self._make_block)

    def _random_ids(self, stream: int, key: int, count: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, stream, key & 0xFFFFFFFFFFFFFFFF])
        return rng.integers(self.low_id, self.vocab_size, size=count, dtype=np.int64)

    def _make_block(self, hash_id: int, block_len: int) -> np.ndarray:
        return self._random_ids(_BLOCK_STREAM, hash_id, block_len)

    def prompt(self, spec: RequestSpec) -> list[int]:
        """The request's `prompt` field: token ids."""
        return self.prompt_ids(spec)

    def prompt_ids(self, spec: RequestSpec) -> list[int]:
        """Exactly `spec.input_len` token ids: the hash blocks first, then a per-request tail."""
        parts: list[np.ndarray] = []
        filled = 0
        for hash_id in spec.hash_ids:
            if filled >= spec.input_len:
                break
            parts.append(self._block(hash_id, spec.block_len))
            filled += spec.block_len
        if filled < spec.input_len:
            parts.append(self._random_ids(_TAIL_STREAM, spec.req_index, spec.input_len - filled))
        ids = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        return ids[: spec.input_len].tolist()
