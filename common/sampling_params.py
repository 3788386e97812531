"""Per-request sampling parameters, validated: what the router checks a request against and
the engines receive. Torch-free, so that the router (and its replicas' start) never imports the
engine's sampler."""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec

from common.protocol import SamplingSpec
from common.structured.spec import MAX_SPEC_CHARS

MAX_INT = 1 << 31  # counts and token ids
MAX_SEED = 1 << 63
# Each generated token is checked against every stop string and id: bounded, so that one request
# cannot make its own tokens (and its batch-mates' steps) arbitrarily slow.
MAX_STOP = 16  # stop strings per request
MAX_STOP_LENGTH = 1024  # characters per stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
MAX_LOGPROBS = 20  # top logprobs per token, as OpenAI allows
# vLLM's allowed_token_ids and bad_words: bounded like the other lists (each is checked per step).
MAX_ALLOWED_TOKEN_IDS = 1 << 18
MAX_BAD_WORDS = 128  # token sequences (a word makes one or two: with and without a space)
MAX_BAD_WORD_TOKENS = 64


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling controls, OpenAI-style. Invalid values raise `ValueError` naming them.

    `temperature == 0` is greedy. `seed` makes sampling reproducible regardless of what else is in
    the batch. `ignore_eos` keeps generating past EOS (trace replay forces output lengths).
    `detokenize=False` (vLLM's option) skips the text for callers that want token ids only; stop
    strings need the text, so they require it. `include_stop_str_in_output` keeps a matched stop
    string in the text; `skip_special_tokens=False` decodes special tokens as text (both vLLM's,
    for whoever makes the text). `allowed_token_ids` restricts every step to those ids;
    `bad_words` are token sequences whose last token is banned wherever the output so far ends
    with the rest (vLLM's: the router tokenizes the words); neither goes with a structured
    output. `structured_output` is a canonical spec from
    `common.structured.parse_structured_output` (validated there; the engine compiles it): the
    grammar decides where the output ends, so it excludes `ignore_eos` and `min_tokens`.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_output: str | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: tuple[int, ...] = ()  # empty: every token
    bad_words: tuple[tuple[int, ...], ...] = ()
    # vLLM's request priority (lower: sooner): orders the mesh router's KV wait queue and every
    # engine's queue of prompts waiting for a prefill.
    priority: int = 0

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
        self._check_processors()
        self._check_structured_output()

    def _check_processors(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(math.isfinite(value) and -2.0 <= value <= 2.0, name, "in [-2, 2]")
        rep = self.repetition_penalty
        _check(math.isfinite(rep) and rep > 0.0, "repetition_penalty", "a finite number > 0")
        _check(0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]")
        ids = [token_id for token_id, _ in self.logit_bias]
        _check(
            len(self.logit_bias) <= MAX_LOGIT_BIAS
            and all(isinstance(t, int) and 0 <= t < MAX_INT for t in ids)
            and len(set(ids)) == len(ids)
            and all(math.isfinite(b) and -100.0 <= b <= 100.0 for _, b in self.logit_bias),
            "logit_bias",
            f"at most {MAX_LOGIT_BIAS} distinct token ids in [0, {MAX_INT}), biases in [-100, 100]",
        )
        _check(
            len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS
            and all(isinstance(t, int) and 0 <= t < MAX_INT for t in self.allowed_token_ids),
            "allowed_token_ids", f"at most {MAX_ALLOWED_TOKEN_IDS} ids in [0, {MAX_INT})",
        )  # fmt: skip
        _check(
            len(self.bad_words) <= MAX_BAD_WORDS
            and all(0 < len(w) <= MAX_BAD_WORD_TOKENS and all(0 <= t < MAX_INT for t in w)
                    for w in self.bad_words),
            "bad_words", f"at most {MAX_BAD_WORDS} sequences of 1 to {MAX_BAD_WORD_TOKENS} ids",
        )  # fmt: skip
        _check(isinstance(self.priority, int) and -MAX_INT < self.priority < MAX_INT, "priority",
               f"an int in (-{MAX_INT}, {MAX_INT})")  # fmt: skip
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS),
                   name, f"None (off) or in [0, {MAX_LOGPROBS}]")  # fmt: skip

    def _check_structured_output(self) -> None:
        spec = self.structured_output
        if spec is None:
            return
        _check(isinstance(spec, str) and 0 < len(spec) <= MAX_SPEC_CHARS, "structured_output",
               f"None or a spec of at most {MAX_SPEC_CHARS} characters")  # fmt: skip
        # NOTE: a grammar that has ended allows EOS alone: generating past it (or refusing to end
        # before min_tokens) would leave no token to sample.
        _check(not self.ignore_eos, "ignore_eos", "False when the output is structured")
        _check(self.min_tokens == 0, "min_tokens", "0 when the output is structured")
        # NOTE: a token list or ban on top of the grammar's mask could leave no token at all.
        _check(not self.allowed_token_ids, "allowed_token_ids", "empty when the output is "
               "structured")  # fmt: skip
        _check(not self.bad_words, "bad_words", "empty when the output is structured")

    def check_vocab(self, vocab_size: int) -> None:
        """The checks that need the model: logit_bias and allowed_token_ids ids must be its
        token ids."""
        _check(all(t < vocab_size for t, _ in self.logit_bias), "logit_bias",
               f"keyed by token ids in [0, {vocab_size})")  # fmt: skip
        _check(all(t < vocab_size for t in self.allowed_token_ids), "allowed_token_ids",
               f"token ids in [0, {vocab_size})")  # fmt: skip
        _check(all(t < vocab_size for w in self.bad_words for t in w), "bad_words",
               f"token ids in [0, {vocab_size})")  # fmt: skip

    @property
    def has_processors(self) -> bool:
        """Whether the logits need more than temperature/top-k/top-p (bias, allowed ids, bad
        words, penalties, min_p)."""
        return (
            bool(self.logit_bias or self.allowed_token_ids or self.bad_words)
            or self.needs_history or self.min_p > 0.0
        )  # fmt: skip

    @property
    def needs_history(self) -> bool:
        """Whether sampling reads the request's tokens so far (the penalties)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_spec(cls, spec: SamplingSpec) -> SamplingParams:
        """From the wire: every field the spec carries, validated again here."""
        fields = msgspec.structs.asdict(spec)
        fields["structured_output"] = spec.structured_output or None
        return cls(**fields)

    def to_spec(self) -> SamplingSpec:
        """The engines' part, for the wire (stop strings and how text is made stay with the
        router)."""
        fields = {name: getattr(self, name) for name in SamplingSpec.__struct_fields__}
        fields["structured_output"] = self.structured_output or ""
        return SamplingSpec(**fields)


def _check(ok: bool, name: str, expected: str) -> None:
    if not ok:
        raise ValueError(f"invalid sampling parameter {name}: must be {expected}")
