"""The pieces every message shares: the sampling spec, token logprobs, a shard's address, and
`_Msg`, the base of every tagged message (conventions: `common/protocol/__init__.py`)."""

from __future__ import annotations

import msgspec

# -- shared pieces ---------------------------------------------------------------------------------


class SamplingSpec(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """`common.sampling.SamplingParams` on the wire (validated again on arrival)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending
    logprobs: int | None = None  # top logprobs per output token (None: none at all)
    prompt_logprobs: int | None = None  # the same for prompt tokens (completions' echo)
    # The canonical structured-output spec (`common.structured.spec`); "" for free text.
    structured_output: str = ""
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    priority: int = 0  # lower: prefilled sooner


class TokenLogprobs(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """One token's log probability under the model's raw distribution (log_softmax of its logits,
    before any sampling parameter), and the `top_ids` most likely tokens' (most likely first)."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    rank: int = 0  # 1 + how many tokens the model finds likelier (0: not known)


class ShardAddress(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One attention shard of a token engine's group (or a token engine's own KV, heads all):
    where it receives KV pages (`kv_address`, UCX) and their frees (`kv_endpoint`, ZeroMQ), which
    KV heads it holds, and (for the token engine) its UCX link address and service id."""

    kv_endpoint: str  # ZeroMQ: frees and shutdown; KV pages too where `kv_address` is empty
    head_start: int
    head_end: int
    link_address: str = ""  # the shard's UCX worker address, hex (`UcxListener.address`)
    service_id: str = ""
    kv_address: str = ""  # its KV listener's UCX worker address, hex (`KvReceiver.address`)


class _Msg(msgspec.Struct, tag_field="kind", array_like=True, omit_defaults=True):
    pass
