"""Every control message of PhaseMesh, as msgspec Structs: one tagged union per socket direction.

Conventions (STYLE.md): `tag_field="kind"`, `array_like=True`, `omit_defaults=True`; new fields
get defaults and go at the end; `gc=False` only on leaves that hold no containers of objects.
Tensor messages (KV pages, per-layer attention) travel as one of these headers plus raw buffers
(`common/transport/tensor_frames.py`): the header says what the buffers are.
"""

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


class TokenLogprobs(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """One token's log probability under the model's raw distribution (log_softmax of its logits,
    before any sampling parameter), and the `top_ids` most likely tokens' (most likely first)."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


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


# -- router -> prompt engine (commands) ------------------------------------------------------------


class GenerateRequest(_Msg, tag="generate"):
    """Prefill this prompt, stream the first token to `reply_to`, hand decode to `token_engine`.

    KV goes to `shards` (split by KV head) or, when there are none, to the token engine's
    `token_kv_endpoint`. The router picks every destination at admission (Splitwise §IV-A).
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    reply_to: str
    token_engine: str  # the token engine's command endpoint
    token_kv_endpoint: str  # its local-KV ingress (ZeroMQ: frees)
    shards: list[ShardAddress] = []
    traceparent: str = ""
    # A migrated request (its engines died): the tokens it already streamed. The prompt engine
    # prefills prompt + these and samples the next one, so the stream continues where it was.
    output_token_ids: list[int] = []
    token_kv_address: str = ""  # its KV listener over UCX (empty: KV pages on token_kv_endpoint)


class AbortRequest(_Msg, tag="abort"):
    req_id: str


class StatsRequest(_Msg, tag="stats"):
    pass


class Shutdown(_Msg, tag="shutdown"):
    pass


# -- prompt engine -> token engine (commands) ------------------------------------------------------


class DecodeHandoff(_Msg, tag="handoff"):
    """A prefilled request: its tokens so far (prompt + first token) and where its KV went."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingSpec
    reply_to: str
    num_kv_layers: int  # layers of KV the token engine must see before decoding locally
    shards: list[ShardAddress] = []  # empty: the KV went to the token engine itself
    traceparent: str = ""


class LinkShards(_Msg, tag="link_shards"):
    """The token engine's shard group from now on (empty: local attention until a new one).

    Sent by whoever keeps the group whole (`services.mesh.shard_group`): the engine drops links
    to shards not in it, links to the new ones, and requests decoding against a lost shard end
    with a retryable error so the router re-runs them elsewhere.
    """

    shards: list[ShardAddress]


class LinkPeers(_Msg, tag="link_peers"):
    """The token engine's model peers from now on, by UCX address, in rotation order (Lamina 4.3;
    services/engine/rotation.py). Idempotent: links to listed peers stay, unlisted ones close,
    and a listed peer that is not linked (new, or dropped for a fault) is linked again. Sent by
    whoever keeps the peers (`services.mesh.peer_group`, the local supervisor), also as a
    periodic reminder, so that a dropped peer that is still alive rejoins."""

    peers: list[str]


class SetRole(_Msg, tag="set_role"):
    """Router -> engine: serve in `role` (its home role, or mixed) from now on. Idempotent.

    Lending an engine to the mixed pool (Splitwise §IV-A) is a lease: the engine goes home by
    itself `lease_s` after the last `SetRole(mixed)`, so a router that dies mid-borrow strands
    nothing; the routers that still want it mixed renew. Running requests and their KV stay.
    """

    role: str
    lease_s: float = 0.0


EngineCommand = (
    GenerateRequest
    | DecodeHandoff
    | AbortRequest
    | StatsRequest
    | Shutdown
    | LinkShards
    | SetRole
    | LinkPeers
)


# -- engines -> router (token stream) --------------------------------------------------------------


class TokenOutput(_Msg, tag="tokens"):
    """New tokens of one request; `finish_reason` set on the last message ('' while running).

    NOTE: the first token comes from the prompt engine and the rest from the token engine, on
    different connections, so they can arrive out of order: `index` (the position of
    `token_ids[0]` in the output) lets the receiver restore the order (`TokenStreamOrderer`).
    """

    req_id: str
    token_ids: list[int]
    finish_reason: str = ""
    num_prompt_tokens: int = 0
    error: str = ""
    index: int = 0
    # The error is the service's, not the request's (a shard link broke): the router may re-run
    # the request elsewhere from its tokens instead of failing it.
    retryable: bool = False
    # Requests that ask for them: one per token of `token_ids`, and (with the first token) one
    # per prompt token after the first. Empty, and not sent, otherwise.
    logprobs: list[TokenLogprobs] = []
    prompt_logprobs: list[TokenLogprobs] = []


class TokenBatch(_Msg, tag="token_batch"):
    """One engine step's plain outputs for one router: one token each, as parallel arrays (one
    message and one decode per step, not one per token per request). Entry `i` means
    `TokenOutput(req_ids[i], [token_ids[i]], finish_reasons[i], num_prompt_tokens[i],
    index=indexes[i])`; what else an output may carry (an error, logprobs, several tokens)
    travels as its own `TokenOutput`. Arrays of different lengths fail decoding: the batch is
    dropped whole (and logged) by the receiving socket."""

    req_ids: list[str]
    token_ids: list[int]
    indexes: list[int]
    finish_reasons: list[str]
    num_prompt_tokens: list[int]

    def __post_init__(self) -> None:
        num = len(self.req_ids)
        lengths = (len(self.token_ids), len(self.indexes), len(self.finish_reasons),
                   len(self.num_prompt_tokens))  # fmt: skip
        if any(n != num for n in lengths):
            raise ValueError(f"token batch arrays differ in length: {num}, {lengths}")

    def outputs(self) -> list[TokenOutput]:
        return [
            TokenOutput(req_id, [token], reason, num_prompt, index=index)
            for req_id, token, index, reason, num_prompt in zip(
                self.req_ids, self.token_ids, self.indexes, self.finish_reasons,
                self.num_prompt_tokens, strict=True,
            )
        ]  # fmt: skip


class KvEvent(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """When KV of a request moved: `received` (layer_start landed) or `prefilled` (its last
    layer was computed). Services keep the most recent ones, for tests and benchmarks."""

    what: str
    req_id: str
    layer_start: int
    time: float  # time.monotonic(), comparable across processes of one host
    # `received`: when the sender handed these pages to the transport (`KvPages.sent_at`), so
    # the overlap of a transfer with its prefill is seen apart from when the receiver ran.
    sent_at: float = 0.0


class DecodeBreakdown(msgspec.Struct, array_like=True, gc=False):
    """A token engine's sharded decode steps since start, in seconds summed over steps (Lamina
    Fig. 12): the steps, the engine blocked on shard replies (idle; the rest is model time), and
    per layer the slowest shard's attention and the rest of its round trip (network)."""

    num_steps: int = 0
    step_s: float = 0.0
    wait_s: float = 0.0
    attend_s: float = 0.0
    network_s: float = 0.0


class EngineStats(_Msg, tag="engine_stats"):
    """Reply to StatsRequest: what a service holds right now (tests use it to prove no leaks)."""

    service_id: str
    role: str
    kv_blocks_used: int
    kv_blocks_total: int
    num_requests: int
    kv_events: list[KvEvent] = []
    # Prompt tokens prefilled here, and those found in the prefix cache instead (since start).
    num_prefill_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    home_role: str = ""  # an engine's configured pool; `role` is the one it serves in now
    num_loans: int = 0  # times it was lent to the mixed pool (since start)
    decode_breakdown: DecodeBreakdown | None = None  # token engines with a shard group
    # A token engine's decode steps, and those run as two sub-batches (Neo §3.1), since start.
    num_decode_steps: int = 0
    num_two_batch_steps: int = 0
    # Its recent decode steps' [predicted s, measured s, kind], when its tier policy predicts step
    # times (Neo); kind 0.0: local rows only, 1.0: one batch with shard rows, 2.0: two sub-batches.
    step_times_s: list[list[float]] = []
    # Decode lanes' layer slices its model peers ran, and peers it lost, since start (Lamina 4.3).
    num_peer_slices: int = 0
    num_peers_lost: int = 0
    # Peer links made since start, the first ones included: more than its peers means re-links
    # (a peer back after a loss, or a replacement: `LinkPeers`).
    num_peers_joined: int = 0
    # Times a token engine's shard group changed since start: its link to a shard failed, or
    # its keeper sent a `LinkShards` (a shard lost, its replacement claimed).
    num_group_relinks: int = 0


ServiceReply = TokenOutput | TokenBatch | EngineStats


# -- engines -> routers (load reports, PUB/SUB) ----------------------------------------------------


class LoadReport(_Msg, tag="load"):
    """What JSQ needs (Splitwise §IV-A): pending prompt tokens, decode tokens, free KV blocks."""

    engine_id: str
    role: str  # the pool it serves in now: every router's pool view is these reports
    pending_prompt_tokens: int
    running_decode_tokens: int
    num_running: int
    num_waiting: int
    free_kv_blocks: int
    time: float = 0.0
    # A token engine's linked shard group (KV endpoints): it knows of a lost shard before the
    # registry does, and the router places on it with local attention until it is whole again.
    shard_endpoints: list[str] = []
    # Its prefix cache's news since the last report (`common.kv_events.CacheDigest`): block hashes
    # stored and evicted, or all it holds when `kv_snapshot`; `kv_seq` numbers the digests so a
    # router notices one lost on the way (PUB/SUB drops under load) and waits for a snapshot.
    kv_seq: int = 0
    kv_snapshot: bool = False
    kv_added: list[int] = []
    kv_removed: list[int] = []
    home_role: str = ""  # its configured pool, where it returns from mixed; empty: `role`
    # With request-level shard partitioning: the KV tokens each shard of `shard_endpoints` holds
    # for it (whole-length reservations), which the router balances new requests by.
    shard_kv_tokens: list[int] = []


# -- prompt engine -> shard or token engine (KV pages; header of a tensor message) -----------------


class KvPages(_Msg, tag="kv"):
    """K/V of `num_tokens` tokens for layers [layer_start, layer_start + num_layers), heads
    [head_start, head_end). Buffers: k, v, each [num_layers, num_tokens, num_heads, head_dim].
    `total_layers` tells the receiver when the request's KV is complete. `reserve_tokens`: the
    request's whole length (prompt + max_tokens) when it will decode against the receiver (a
    shard): the receiver holds blocks for all of it from the first page on, or refuses it then,
    because a shard cannot preempt and a request it could not grow would fail mid-stream.
    `traceparent` is the request's trace context: the receiver's `kv.receive` span joins it."""

    req_id: str
    layer_start: int
    num_layers: int
    num_tokens: int
    head_start: int
    head_end: int
    total_layers: int
    sent_at: float = 0.0
    reserve_tokens: int = 0  # 0: the prompt only (a token engine's own KV, which can preempt)
    traceparent: str = ""
    # A token engine swapping the request's KV out to this shard (Neo's offload tier): the
    # shard's UCX KV listener to answer with a `KvSwapAck` once all layers landed (or were
    # refused). Also lets the KV land after the request was freed here before (swapped in).
    ack_to: str = ""


class FreeRequest(_Msg, tag="free"):
    """Drop a request's KV (finished or aborted); idempotent, and arrives-before-KV safe."""

    req_id: str


class FetchKv(_Msg, tag="fetch_kv"):
    """Token engine -> shard (swap-in, Neo): send this request's KV (its first `num_tokens`
    tokens, every layer, the shard's heads) to `reply_to` (the engine's UCX KV listener) as
    `KvPages`, one per layer, and drop it here: the KV moves (a swap-in that does not finish
    ends its request, which is re-run from its tokens). Dropping it at once, and not on a later
    `FreeRequest`, keeps a swap-out that follows from racing a free. A shard that does not hold
    it answers a `KvSwapAck` with an error instead."""

    req_id: str
    num_tokens: int
    reply_to: str


class KvSwapAck(_Msg, tag="kv_swap_ack"):
    """Shard -> token engine: a swap-out's KV (`KvPages.ack_to`) landed whole for heads
    [head_start, head_end), or (`error`) it did not, or a `FetchKv` could not be served."""

    req_id: str
    head_start: int
    head_end: int
    error: str = ""


class KvAnnounce(_Msg, tag="kv_announce"):
    """`kv_transfer: pull`: a prompt engine holds all of a request's KV for heads
    [head_start, head_end) and this shard is to pull it from `source` (the prompt engine's
    KV-hold ROUTER endpoint, `common/kv_hold.py`) in a free period between decode steps.
    `traceparent`: the request's trace context, for the shard's `kv.pull` span ("" untraced)."""

    req_id: str
    source: str
    head_start: int
    head_end: int
    traceparent: str = ""


ShardIngress = KvPages | FreeRequest | StatsRequest | Shutdown | KvAnnounce | FetchKv | KvSwapAck
# A KV-ingress ZeroMQ socket where KV pages travel over UCX (`common/transport/kv_links.py`): a
# KvPages sent to it is malformed there, logged and dropped.
KvControl = FreeRequest | StatsRequest | Shutdown | KvAnnounce | FetchKv


# -- shard <-> prompt engine's KV hold (`kv_transfer: pull`) -------------------------------------


class KvPull(_Msg, tag="kv_pull"):
    """A shard asks for a held request's KV of its heads; the answer is one `KvPages` carrying
    every layer (buffers k, v) or a `KvPullMiss`. The hold forgets what it answered."""

    req_id: str
    head_start: int
    head_end: int


class KvPullMiss(_Msg, tag="kv_pull_miss"):
    """The hold has no complete KV for that request and heads (expired, aborted, never held)."""

    req_id: str
    why: str


KvPullReply = KvPages | KvPullMiss


# -- token engine <-> shard (per-layer decode attention; headers of tensor messages) ---------------


class AttendBatch(_Msg, tag="attend"):
    """One layer of one decode step. Buffers: q [N, Hq_shard, D], k and v [N, Hkv_shard, D].

    `req_ids` and `context_lens` are sent on layer 0 only: the batch is the same for every layer of
    a step, so the shard builds its block tables once per step. `traceparent`, also on layer 0
    only, is set on the steps the token engine traces (sampled): its `token.step` span, which the
    shard's `shard.attend` span is a child of. Empty: the shard does no tracing work this step.
    """

    step: int
    layer: int
    req_ids: list[str] = []
    context_lens: list[int] = []
    traceparent: str = ""
    # Lamina 4.2.2 (`attention_overlap`): a layer comes in two parts, ATTEND_PREV (buffer: q
    # only; the shard attends over the tokens before this step while the engine computes k/v)
    # then ATTEND_NEW (buffers: k, v; the shard appends them, adds the new token's part and
    # answers once). ATTEND_WHOLE: q, k, v in one message.
    part: int = 0
    # Lamina 4.3 (`decode_lanes`): which of the engine's concurrent sub-batches this is; a shard
    # keeps one step's block tables per lane, and its reply carries the lane back.
    lane: int = 0


ATTEND_WHOLE, ATTEND_PREV, ATTEND_NEW = 0, 1, 2  # `AttendBatch.part`


class AttendResult(_Msg, tag="attend_result"):
    """Buffers: out [N, Hq_shard, D] float32 and lse [N, Hq_shard] float32."""

    step: int
    layer: int
    error: str = ""
    # Requests of the step this shard could not attend for (their KV was refused, never came, or
    # could not grow): their rows are meaningless; the token engine ends each one alone.
    failed: list[str] = []
    # Requests whose KV landed whole here, or was lost here (refused, or its pull failed), since
    # the shard's last reply: a token engine on `kv_transfer: pull` admits a request to its
    # decode steps once every shard of its group said it landed (none waits at layer 0 for it).
    kv_landed: list[str] = []
    kv_lost: list[str] = []
    lane: int = 0  # `AttendBatch.lane` of the batch answered
    attend_s: float = 0.0  # the shard's attention time for this layer (both parts, overlapped)


class KvReadyQuery(_Msg, tag="kv_ready_query"):
    """An idle token engine (no step to run, hand-offs waiting for their KV) asks each shard for
    its `kv_landed`/`kv_lost` news; the shard answers an `AttendResult` with `layer=-1`, no
    buffers, waiting up to `wait_s` for news if it has none. (Also sent, with no wait, between
    steps to the shards of a request-partitioned group that had no rows in a step.)"""

    step: int
    wait_s: float = 0.0


ShardLinkMessage = AttendBatch | AttendResult | KvReadyQuery


# -- token engine <-> model peer (Lamina 4.3's rotation over model replicas; headers of tensor
# messages: services/engine/rotation.py, model_peer.py) --------------------------------------------


class SliceRequest(_Msg, tag="slice"):
    """One decode lane's layer slice for a model peer to run: the previous layer's
    post_attention (layer > 0), then this layer's pre_attention. Buffers: x [N, hidden] (the
    previous layer's input, or the embeddings at layer 0), positions [N] int64, and for
    layer > 0 that layer's attention output [N, Hq, D] float32."""

    step: int
    lane: int
    layer: int


class SliceResult(_Msg, tag="slice_result"):
    """Buffers: x [N, hidden] (this layer's input), q [N, Hq, D], k and v [N, Hkv, D]; none
    with an `error` (the token engine then runs the slice itself)."""

    step: int
    lane: int
    layer: int
    error: str = ""
    run_s: float = 0.0  # the peer's compute time for the slice


PeerLinkMessage = SliceRequest | SliceResult
