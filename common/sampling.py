"""The batched sampler: a token per row from the step's logits, under each request's
`SamplingParams` (common/sampling_params.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from common.logits_processors import (
    History,
    apply_allowed_tokens,
    apply_bad_words,
    apply_logit_bias,
    apply_penalties,
    min_p_mask,
)
from common.logprobs import token_logprobs
from common.protocol import TokenLogprobs
from common.sampling_params import SamplingParams
from common.structured.grammar import GrammarMatcher
from common.structured.masks import MaskFiller, apply_masks

# Below this temperature a softmax over float32 logits overflows: sample greedily instead.
MIN_TEMPERATURE = 1e-4


@dataclass
class SamplerOutput:
    """One step's sampling: a token per row, the rows that failed ({row: why}; their tokens are
    meaningless) and, for rows that asked, the sampled token's logprobs (else None)."""

    token_ids: list[int]
    failures: dict[int, Exception]
    logprobs: list[TokenLogprobs | None]

    def rows(self, prompt_logprobs: Sequence[list[TokenLogprobs] | None] = ()) -> list[SampledRow]:
        """Per row: its token (or why it failed), its logprobs and its prompt's."""
        prompt = list(prompt_logprobs) or [None] * len(self.token_ids)
        return [
            SampledRow(self.failures.get(row, token), self.logprobs[row], prompt[row])
            for row, token in enumerate(self.token_ids)
        ]


class SampledRow(NamedTuple):
    """One request's part of a step: its token (the exception instead when its sampling failed),
    the token's logprobs and, after its prefill, its prompt's (each when asked for)."""

    token: int | Exception
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None


def takes_raw_argmax(params: SamplingParams, grammar: GrammarMatcher | None = None) -> bool:
    """Whether a row's token is the argmax of its raw logits and it needs nothing else of them:
    greedy (or a near-zero temperature), no processor, no grammar, no logprobs. Such rows can
    run several decode steps in one call (`LLMEngine`'s `num_scheduler_steps`)."""
    return (
        (params.greedy or params.temperature < MIN_TEMPERATURE)
        and not params.has_processors
        and params.logprobs is None
        and grammar is None
    )


class Sampler:
    """Samples one token per row of logits; greedy rows take one batched argmax.

    Order (vLLM's): logit_bias and penalties, the grammar masks (structured output) and an
    optional allowed-token mask, the greedy argmax; then, for random rows, min_p, temperature,
    top-k, top-p and the draw. A grammar row's sampled token then advances its matcher; a token
    the grammar refuses fails that row. Logprobs are always of the raw model logits (vLLM's
    default), before any of this. The
    processors run batched over the rows that use them (`common.logits_processors`); a step where
    no row uses one costs what it did before they existed.

    Per-row: a row that fails to sample is reported (`failures`) and the other rows keep their
    tokens, so one request's parameters never fail its batch-mates (a batched processor that
    raises is re-run row by row to find the culprit). For parameters that pass validation and
    finite logits it always returns a token: a near-zero temperature samples greedily, and a
    top-p/top-k cut that leaves nothing keeps the top token (vLLM does the same).

    Seeded rows draw from a generator seeded by (seed, output index): the same request samples the
    same tokens whatever its batch, and a request re-run elsewhere from its tokens (token-replay
    migration) continues with exactly the draws it would have made.

    Grammar rows' next masks are filled ahead (`MaskFiller.prefetch`) as soon as their tokens are
    accepted, so the next step finds them done instead of filling them on the engine's thread.
    """

    def __init__(self) -> None:
        self._masks: MaskFiller | None = None  # built at the first grammar row (it owns threads)

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        output_lens: list[int],
        histories: Sequence[History] | None = None,
        allowed_mask: torch.Tensor | None = None,
        grammars: Sequence[GrammarMatcher | None] = (),
    ) -> SamplerOutput:
        """logits [N, vocab] float32. `output_lens`: how many tokens each request has produced
        before this one; `histories`: each request's (prompt ids, output ids), read by rows with
        penalties; `allowed_mask` [N, vocab] bool: tokens a row may take (None: all);
        `grammars`: each row's grammar matcher (None, or empty for all: no grammar), advanced by
        the row's token."""
        failures: dict[int, Exception] = {}
        grammars = list(grammars) or [None] * len(params)
        processed = self._process(logits, params, histories, allowed_mask, grammars, failures)
        # NOTE: numpy's argmax, not torch's: on decode-sized float32 logits torch's costs several
        # times numpy's; both return the first maximal index (and a NaN's first). On a device,
        # torch's there: N ids cross to the host, not [N, vocab] logits.
        if processed.device.type == "cpu":
            token_ids = processed.detach().numpy().argmax(axis=-1).tolist()
        else:
            token_ids = processed.argmax(dim=-1).tolist()
        random_rows = [
            row for row, p in enumerate(params)
            if not (p.greedy or p.temperature < MIN_TEMPERATURE) and row not in failures
        ]  # fmt: skip
        processed = self._apply_min_p(processed, params, random_rows)
        for row in random_rows:
            p = params[row]
            try:
                gen = None if p.seed is None else _generator(p.seed, output_lens[row])
                token_ids[row] = _sample_row(processed[row], p, gen, token_ids[row])
            except Exception as exc:  # noqa: BLE001 - that row's request alone fails
                failures[row] = exc
        _accept(grammars, token_ids, failures)
        self._prefetch_masks(grammars, params, output_lens, token_ids, failures)
        return SamplerOutput(token_ids, failures, _logprobs(logits, params, token_ids))

    def _mask_filler(self) -> MaskFiller:
        if self._masks is None:
            self._masks = MaskFiller()
        return self._masks

    def _prefetch_masks(
        self,
        grammars: list[GrammarMatcher | None],
        params: list[SamplingParams],
        output_lens: list[int],
        token_ids: list[int],
        failures: dict[int, Exception],
    ) -> None:
        """Start filling the next masks of the grammar rows that go on: not failed, not ended by
        this token (EOS, which a structured request never ignores) or by max_tokens."""
        going_on = [
            grammar for row, grammar in enumerate(grammars)
            if grammar is not None and row not in failures
            and output_lens[row] + 1 < params[row].max_tokens
            and not grammar.is_eos(token_ids[row])
        ]  # fmt: skip
        if going_on:
            self._mask_filler().prefetch(going_on)

    def _process(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        histories: Sequence[History] | None,
        allowed_mask: torch.Tensor | None,
        grammars: list[GrammarMatcher | None],
        failures: dict[int, Exception],
    ) -> torch.Tensor:
        """Logits after bias and penalties (and the grammar and allowed masks); `logits` itself
        if no row has any, else a copy. Rows whose processors raise are reported in `failures`."""
        rows = [row for row, p in enumerate(params) if p.has_processors]
        has_grammar = any(g is not None for g in grammars)
        if not rows and allowed_mask is None and not has_grammar:
            return logits
        out = logits.clone()
        if rows:
            try:
                _process_rows(out, rows, params, histories)
            except Exception:  # noqa: BLE001 - find the row at fault, the others go on
                for row in rows:
                    try:
                        _process_rows(out, [row], params, histories)
                    except Exception as exc:  # noqa: BLE001 - that row's request alone fails
                        failures[row] = exc
        if has_grammar:
            _mask_grammar_rows(out, grammars, failures, self._mask_filler())
        if allowed_mask is not None:
            out.masked_fill_(~allowed_mask, float("-inf"))
        return out

    def _apply_min_p(
        self, logits: torch.Tensor, params: list[SamplingParams], random_rows: list[int]
    ) -> torch.Tensor:
        """Random rows with min_p: one batched mask at each row's temperature (greedy rows never
        need it: the top token always stays)."""
        rows = [row for row in random_rows if params[row].min_p > 0.0]
        if not rows:
            return logits
        d = logits.device
        index = torch.tensor(rows, device=d)
        min_p = torch.tensor([params[r].min_p for r in rows], dtype=logits.dtype, device=d)
        temperature = torch.tensor(
            [params[r].temperature for r in rows], dtype=logits.dtype, device=d
        )
        selected = logits[index]  # [R, vocab]
        drop = min_p_mask(selected, min_p, temperature)
        out = logits.clone()  # `logits` may be the model's, which logprobs read
        out[index] = selected.masked_fill(drop, float("-inf"))
        return out


def _process_rows(
    logits: torch.Tensor,
    rows: list[int],
    params: list[SamplingParams],
    histories: Sequence[History] | None,
) -> None:
    """Bias, allowed ids, bad words then penalties for `rows` of `logits` [N, vocab], in
    place."""
    vocab_size = logits.shape[-1]
    for row in rows:  # checked where the vocabulary is known; here in case it was not
        params[row].check_vocab(vocab_size)
    index = torch.tensor(rows, device=logits.device)
    selected = logits[index]  # [R, vocab], a copy
    row_params = [params[r] for r in rows]
    apply_logit_bias(selected, row_params)
    apply_allowed_tokens(selected, row_params)
    if any(p.bad_words for p in row_params):
        if histories is None:
            raise ValueError("bad_words need the request's tokens")
        apply_bad_words(selected, row_params, [histories[r][1] for r in rows])
    penalized = [i for i, p in enumerate(row_params) if p.needs_history]
    if penalized:
        if histories is None:
            raise ValueError("penalties need the request's tokens")
        sub = torch.tensor(penalized, device=logits.device)
        selected[sub] = apply_penalties(
            selected[sub], [row_params[i] for i in penalized],
            [histories[rows[i]] for i in penalized],
        )  # fmt: skip
    logits[index] = selected


def _mask_grammar_rows(
    logits: torch.Tensor,
    grammars: list[GrammarMatcher | None],
    failures: dict[int, Exception],
    filler: MaskFiller,
) -> None:
    """Grammar masks in place, batched; if that raises, row by row to find the culprit."""
    try:
        apply_masks(logits, grammars, filler)
    except Exception:  # noqa: BLE001 - the row at fault fails, the others are masked
        for row, grammar in enumerate(grammars):
            if grammar is None:
                continue
            try:
                apply_masks(logits[row : row + 1], [grammar])
            except Exception as exc:  # noqa: BLE001 - that row's request alone fails
                failures[row] = exc


def _accept(
    grammars: list[GrammarMatcher | None], token_ids: list[int], failures: dict[int, Exception]
) -> None:
    """Advance each grammar row's matcher by its token; a refused token fails that row."""
    for row, grammar in enumerate(grammars):
        if grammar is None or row in failures:
            continue
        if not grammar.accept(token_ids[row]):
            why = _first_line(grammar.error())
            failures[row] = ValueError(f"token {token_ids[row]} does not follow the grammar: {why}")


def _logprobs(
    logits: torch.Tensor, params: list[SamplingParams], token_ids: list[int]
) -> list[TokenLogprobs | None]:
    """The sampled tokens' logprobs (raw model distribution, `common.logprobs`) for the rows that
    asked; one batched log_softmax over those rows."""
    result: list[TokenLogprobs | None] = [None] * len(params)
    rows = [row for row, p in enumerate(params) if p.logprobs is not None]
    if rows:
        num_top = [params[r].logprobs or 0 for r in rows]
        picked = logits[torch.tensor(rows, device=logits.device)]
        found = token_logprobs(picked, [token_ids[r] for r in rows], num_top)
        for row, lp in zip(rows, found, strict=True):
            result[row] = lp
    return result


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
    if gen is not None and probs.device.type != "cpu":
        # A seeded draw is the host generator's, on any device: the same tokens everywhere.
        probs = probs.cpu()
    return int(torch.multinomial(probs, 1, generator=gen).item())


def _first_line(error: str, limit: int = 200) -> str:
    """llguidance's error without the parser state it dumps after it."""
    return error.strip().split("\n", 1)[0][:limit]
