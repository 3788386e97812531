"""Control messages: router and engine commands, the token stream and stats, load reports."""

from __future__ import annotations

from typing import Annotated

import msgspec

from common.protocol.base import SamplingSpec, ShardAddress, TokenLogprobs, _Msg
from common.roles import Role

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
    to shards not in it and links to the new ones. Requests decoding against a lost shard of a
    head-split group wait for its replacement, whose heads' KV a prompt engine of `rebuilders`
    recomputes from their tokens (`RebuildKv`, Lamina §5); where that cannot be, they end with a
    retryable error so the router re-runs them elsewhere.
    """

    shards: list[ShardAddress]
    rebuilders: list[str] = []  # live prompt engines' command endpoints


class RebuildKv(_Msg, tag="rebuild_kv"):
    """Token engine -> prompt engine: recompute the KV of `token_ids` (a running request's
    tokens but its last, whose KV its next decode step writes) and ship only `shards`' heads to
    them (the replacements of lost shards), as a prefill ships; then answer `KvRebuilt` to
    `reply_to` (the token engine's command endpoint). No token is sampled for the client."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingSpec  # its `max_tokens` sizes the shards' reservation, as at its prefill
    shards: list[ShardAddress]
    reply_to: str


class KvRebuilt(_Msg, tag="kv_rebuilt"):
    """Prompt engine -> token engine: a `RebuildKv`'s KV has left for its shards (`error`: it
    could not be computed or sent; the token engine then ends the request, retryably)."""

    req_id: str
    error: str = ""


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

    `home` set: the engine's home moves there (common/scheduling/home_roles.py) and it serves
    in it at once (`role` is the same), any loan ended; its running requests finish where they
    are, and new work follows the routers' pools.
    """

    role: Role
    lease_s: float = 0.0
    home: Role | None = None


EngineCommand = (
    GenerateRequest
    | DecodeHandoff
    | AbortRequest
    | StatsRequest
    | Shutdown
    | LinkShards
    | SetRole
    | LinkPeers
    | RebuildKv
    | KvRebuilt
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


class OutputsDropped(_Msg, tag="outputs_dropped"):
    """An engine could not queue these requests' outputs for this router (its inbox was full:
    the router stopped reading for a while) and gave the requests up. Sent on a socket of its
    own (its own queue, apart from the tokens'), and again until it is queued, so the router
    learns it as soon as it reads again: it re-runs each request from the tokens it has (a
    retryable error of its current attempt) instead of waiting out its progress deadline."""

    req_ids: list[str]
    error: str = ""


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
    role: Role
    kv_blocks_used: int
    kv_blocks_total: int
    num_requests: int
    kv_events: list[KvEvent] = []
    # Prompt tokens prefilled here, and those found in the prefix cache instead (since start).
    num_prefill_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    home_role: Role | None = None  # an engine's configured pool; `role`: the one it serves in now
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
    # Requests whose lost shard heads were rebuilt on a replacement (they kept decoding here),
    # and those that fell back to the router's migration instead, since start.
    num_rebuilt: int = 0
    num_rebuild_fallbacks: int = 0
    # Decodes this engine preempted for KV (its own cache's, or its shard group's) and
    # recomputed, since start (Splitwise's memory-aware batching).
    num_preemptions: int = 0
    num_home_moves: int = 0  # times its home changed since start (home_roles.py)
    # Chunk steps of long prefills it ran, since start (services/engine/prefill_chunks.py).
    num_prefill_chunks: int = 0


ServiceReply = TokenOutput | TokenBatch | EngineStats | OutputsDropped


# -- engines -> routers (load reports, PUB/SUB) ----------------------------------------------------


# A count or a size in a report: a negative one fails decoding, so the receiving socket drops the
# report (logged) instead of JSQ sending every request to an engine that says it holds less than
# nothing.
Count = Annotated[int, msgspec.Meta(ge=0)]


class HistogramCounts(msgspec.Struct, array_like=True, gc=False):
    """One histogram's samples since start: the count in each bucket (+Inf last; not cumulative)
    and their sum."""

    counts: list[Count]
    sum: float = 0.0


class EngineCounters(msgspec.Struct, array_like=True, gc=False):
    """An engine's counts since it started, for the router's `/metrics` (vLLM's engine series:
    services/router/metrics_endpoint.py). Cumulative, so a lost report loses nothing."""

    prefix_cache_queries: Count = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: Count = 0  # of which found cached
    num_preemptions: Count = 0
    kv_blocks_used: Count = 0  # where its decode KV lives, of the report's `total_kv_blocks`
    # By metric name without its prefix (`iteration_tokens_total`, `request_queue_time_seconds`,
    # ...), in that metric's buckets (`common.telemetry.engine_counts.REPORTED_HISTOGRAMS`).
    histograms: dict[str, HistogramCounts] = {}


class LoadReport(_Msg, tag="load"):
    """What JSQ needs (Splitwise §IV-A): pending prompt tokens, decode tokens, free KV blocks."""

    engine_id: str
    # The pool it serves in now: every router's pool view is these reports (None: it does not
    # say; the registry's role stands).
    role: Role | None
    pending_prompt_tokens: Count
    running_decode_tokens: Count
    num_running: Count
    num_waiting: Count
    free_kv_blocks: Count
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
    home_role: Role | None = None  # its configured pool, where it returns from mixed; None: `role`
    # Prompt tokens of the requests it has received since it started (a counter): its arrival
    # rate, which the autoscaling policy sizes prompt engines by (services/mesh/autoscaling.py).
    prompt_tokens_in: Count = 0
    # With request-level shard partitioning: the KV tokens each shard of `shard_endpoints` holds
    # for it (whole-length reservations), which the router balances new requests by.
    shard_kv_tokens: list[Count] = []
    # The requests it holds to prefill and hand off: their tokens (prompt + output so far), by
    # the command endpoint of the token engine each goes to. They are that engine's decode load
    # before its own reports can count them (until the hand-off lands), so a router adds them to
    # its reports instead of forgetting its placements at that engine's next report.
    handoff_tokens: dict[str, Count] = {}
    # The `GenerateRequest`s it has received, by the router that sent them (`reply_to`): a router
    # keeps counting its placements made after the report (those still on the way, or queued
    # behind the engine's step) instead of forgetting them until the next one.
    received_requests: dict[str, Count] = {}
    # KV admission: the `DecodeHandoff`s it has received, by the router of each (a router holds
    # the KV room of its placements on the way here until this count covers them); and the
    # blocks where its decode KV lives (its shard group, or its own cache) in all, so a router
    # refuses at once a request that could never fit there.
    received_handoffs: dict[str, Count] = {}
    total_kv_blocks: Count = 0
    counters: EngineCounters | None = None  # for the router's /metrics; None: not reported
