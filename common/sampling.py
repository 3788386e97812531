"""Sampling parameters (validated) and the batched sampler."""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec
import torch

from common.protocol import SamplingSpec

MAX_INT = 1 << 31  # counts and token ids
MAX_SEED = 1 << 63
# Each generated token is checked against every stop string and id: bounded, so that one request
# cannot make its own tokens (and its batch-mates' steps) arbitrarily slow.
MAX_STOP = 16  # stop strings per request
MAX_STOP_LENGTH = 1024  # characters per stop string
MAX_STOP_TOKEN_IDS = 1024


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling controls, OpenAI-style. Invalid values raise `ValueError` naming them.

    `temperature == 0` is greedy. `seed` makes sampling reproducible regardless of what else is in
    the batch. `ignore_eos` keeps generating past EOS (trace replay forces output lengths).
    `detokenize=False` (vLLM's option) skips the text for callers that want token ids only; stop
    strings need the text, so they require it.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    detokenize: bool = True

    def __post_init__(self) -> None:
        # NOTE: integers are bounded so that every value crosses the wire (msgpack carries at most
        # 64 bits): an unbounded one would fail after admission instead of as a 400.
        _check(isinstance(self.max_tokens, int) and 1 <= self.max_tokens < MAX_INT,
               "max_tokens", f"in [1, {MAX_INT})")  # fmt: skip
        _check(math.isfinite(self.temperature) and self.temperature >= 0.0, "temperature",
               "a finite number >= 0")  # fmt: skip
        _check(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]")
        top_k_ok = self.top_k == -1 or 1 <= self.top_k < MAX_INT
        _check(top_k_ok, "top_k", f"-1 (off) or in [1, {MAX_INT})")
        _check(0 <= self.min_tokens <= self.max_tokens, "min_tokens", "in [0, max_tokens]")
        _check(
            len(self.stop) <= MAX_STOP
            and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_LENGTH for s in self.stop),
            "stop",
            f"at most {MAX_STOP} non-empty strings of at most {MAX_STOP_LENGTH} characters",
        )
        _check(
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS
            and all(0 <= t < MAX_INT for t in self.stop_token_ids),
            "stop_token_ids",
            f"at most {MAX_STOP_TOKEN_IDS} ids in [0, {MAX_INT})",
        )
        _check(self.detokenize or not self.stop, "detokenize", "True when stop strings are given")
        if self.seed is not None:
            _check(isinstance(self.seed, int) and 0 <= self.seed < MAX_SEED, "seed",
                   f"an int in [0, {MAX_SEED})")  # fmt: skip

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_spec(cls, spec: SamplingSpec) -> SamplingParams:
        """From the wire: every field the spec carries, validated again here."""
        return cls(**msgspec.structs.asdict(spec))

    def to_spec(self) -> SamplingSpec:
        """The engines' part, for the wire (stop strings stay with the router)."""
        return SamplingSpec(
            **{name: getattr(self, name) for name in SamplingSpec.__struct_fields__}
        )


def _check(ok: bool, name: str, expected: str) -> None:
    if not ok:
        raise ValueError(f"invalid sampling parameter {name}: must be {expected}")


# Below this temperature a softmax over float32 logits overflows: sample greedily instead.
MIN_TEMPERATURE = 1e-4


class Sampler:
    """Samples one token per row of logits; greedy rows take one batched argmax.

    Per-row: a row that fails to sample is reported (`failures`) and the other rows keep their
    tokens, so one request's parameters never fail its batch-mates. For parameters that pass
    validation and finite logits it always returns a token: a near-zero temperature samples
    greedily, and a top-p/top-k cut that leaves nothing keeps the top token (vLLM does the same).

    Seeded rows draw from a generator seeded by (seed, output index): the same request samples the
    same tokens whatever its batch, and a request re-run elsewhere from its tokens (token-replay
    migration) continues with exactly the draws it would have made.
    """

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], output_lens: list[int]
    ) -> tuple[list[int], dict[int, Exception]]:
        """logits [N, vocab] float32 -> (N token ids, {row: why it failed}); a failed row's id is
        meaningless. `output_lens`: how many tokens each request has produced before this one."""
        # NOTE: numpy's argmax, not torch's: on [32, 2048] float32 logits here torch's takes
        # 77-130 us and numpy's 8 us; both return the first maximal index (and a NaN's first).
        token_ids = logits.detach().cpu().numpy().argmax(axis=-1).tolist()
        failures: dict[int, Exception] = {}
        for row, (p, index) in enumerate(zip(params, output_lens, strict=True)):
            if p.greedy or p.temperature < MIN_TEMPERATURE:
                continue
            try:
                gen = None if p.seed is None else _generator(p.seed, index)
                token_ids[row] = _sample_row(logits[row], p, gen, token_ids[row])
            except Exception as exc:  # noqa: BLE001 - that row's request alone fails
                failures[row] = exc
        return token_ids, failures


def _generator(seed: int, index: int) -> torch.Generator:
    # A counter-based stream: one generator per (seed, position), mixed so nearby seeds and
    # positions do not share draws.
    return torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + index) % (1 << 63))


def _sample_row(
    logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None, top: int
) -> int:
    logits = logits / p.temperature  # [vocab]
    if p.top_k > 0:
        kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
        return top  # nothing left to draw from: the most likely token
    return int(torch.multinomial(probs, 1, generator=gen).item())
