"""Headers of tensor messages (a header plus raw buffers: `common/transport/tensor_frames.py`):
KV pages and their pulls, per-layer decode attention, model-peer layer slices."""

from __future__ import annotations

from common.protocol.base import _Msg
from common.protocol.control import Shutdown, StatsRequest

# -- prompt engine -> shard or token engine (KV pages; header of a tensor message) -----------------


class KvPages(_Msg, tag="kv"):
    """K/V of `num_tokens` tokens for layers [layer_start, layer_start + num_layers), heads
    [head_start, head_end). Buffers: k, v, each [num_layers, num_tokens, num_heads, head_dim].
    `total_layers` tells the receiver when the request's KV is complete. `reserve_tokens`: the
    tokens shipped when the request will decode against the receiver (a shard): it holds blocks
    for them from the first page on (or refuses the request then) and grows them per decode
    step; its token engine preempts requests before the group runs out (engine/admission.py).
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
    # 0: the request's first KV here. n >= 1: its KV recomputed by its token engine after its
    # n-th preemption (engine/admission.py): it lands though the shard freed the request, and
    # replaces an older generation still held (that preemption's free has not come yet).
    kv_generation: int = 0


class FreeRequest(_Msg, tag="free"):
    """Drop a request's KV (finished or aborted); idempotent, and arrives-before-KV safe.
    `kv_generation` set: a preemption frees the KV of that generation only (`KvPages`), and the
    request's next generation is coming (a decode step naming it waits for that one)."""

    req_id: str
    kv_generation: int | None = None


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
    """Buffer: out [N, Hq_shard, D] float32. Not the softmax denominators: the shard combines
    its own partials (overlap), and a token engine has no use for them."""

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
