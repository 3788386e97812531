"""Sampling parameters (validated) and the batched sampler."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch

from common.protocol import SamplingSpec


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
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", ">= 1")
        _check(self.temperature >= 0.0, "temperature", ">= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]")
        _check(self.top_k == -1 or self.top_k >= 1, "top_k", "-1 (off) or >= 1")
        _check(0 <= self.min_tokens <= self.max_tokens, "min_tokens", "in [0, max_tokens]")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "non-negative ids")
        _check(self.detokenize or not self.stop, "detokenize", "True when stop strings are given")
        if self.seed is not None:
            _check(isinstance(self.seed, int) and self.seed >= 0, "seed", "a non-negative int")

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


class Sampler:
    """Samples one token per row of logits; greedy rows take one batched argmax."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, req_id: str) -> None:
        self._generators.pop(req_id, None)

    def sample(
        self, logits: torch.Tensor, req_ids: list[str], params: list[SamplingParams]
    ) -> list[int]:
        """logits [N, vocab] float32 -> N token ids."""
        # NOTE: numpy's argmax, not torch's: on [32, 2048] float32 logits here torch's takes
        # 77-130 us and numpy's 8 us; both return the first maximal index (and a NaN's first).
        token_ids = logits.detach().cpu().numpy().argmax(axis=-1).tolist()
        for row, (req_id, p) in enumerate(zip(req_ids, params, strict=True)):
            if not p.greedy:
                token_ids[row] = self._sample_row(logits[row], p, self._generator(req_id, p))
        return token_ids

    def _generator(self, req_id: str, params: SamplingParams) -> torch.Generator | None:
        if params.seed is None:
            return None
        if req_id not in self._generators:
            self._generators[req_id] = torch.Generator().manual_seed(params.seed)
        return self._generators[req_id]

    @staticmethod
    def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
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
        return int(torch.multinomial(probs, 1, generator=gen).item())
