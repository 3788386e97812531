"""Every control message of PhaseMesh, as msgspec Structs: one tagged union per socket direction.

Conventions (STYLE.md): `tag_field="kind"`, `array_like=True`, `omit_defaults=True`; new fields
get defaults and go at the end; `gc=False` only on leaves that hold no containers of objects.
Tensor messages (KV pages, per-layer attention) travel as one of these headers plus raw buffers
(`common/transport/tensor_frames.py`): the header says what the buffers are.

The types live in three modules (`base`, `control`, `tensors`); import them from here.
"""

from __future__ import annotations

from common.protocol.base import (
    SamplingSpec,
    ShardAddress,
    TokenLogprobs,
)
from common.protocol.control import (
    AbortRequest,
    DecodeBreakdown,
    DecodeHandoff,
    EngineCommand,
    EngineCounters,
    EngineStats,
    GenerateRequest,
    HistogramCounts,
    KvEvent,
    KvRebuilt,
    LinkPeers,
    LinkShards,
    LoadReport,
    OutputsDropped,
    RebuildKv,
    ServiceReply,
    SetRole,
    Shutdown,
    StatsRequest,
    TokenBatch,
    TokenOutput,
)
from common.protocol.tensors import (
    ATTEND_NEW,
    ATTEND_PREV,
    ATTEND_WHOLE,
    AttendBatch,
    AttendResult,
    FetchKv,
    FreeRequest,
    KvAnnounce,
    KvControl,
    KvPages,
    KvPull,
    KvPullMiss,
    KvPullReply,
    KvReadyQuery,
    KvSwapAck,
    PeerLinkMessage,
    ShardIngress,
    ShardLinkMessage,
    SliceRequest,
    SliceResult,
)

__all__ = [
    "ATTEND_NEW",
    "ATTEND_PREV",
    "ATTEND_WHOLE",
    "AbortRequest",
    "AttendBatch",
    "AttendResult",
    "DecodeBreakdown",
    "DecodeHandoff",
    "EngineCommand",
    "EngineCounters",
    "EngineStats",
    "FetchKv",
    "FreeRequest",
    "GenerateRequest",
    "HistogramCounts",
    "KvAnnounce",
    "KvControl",
    "KvEvent",
    "KvRebuilt",
    "KvPages",
    "KvPull",
    "KvPullMiss",
    "KvPullReply",
    "KvReadyQuery",
    "KvSwapAck",
    "LinkPeers",
    "LinkShards",
    "LoadReport",
    "RebuildKv",
    "PeerLinkMessage",
    "SamplingSpec",
    "ServiceReply",
    "SetRole",
    "ShardAddress",
    "ShardIngress",
    "ShardLinkMessage",
    "Shutdown",
    "SliceRequest",
    "SliceResult",
    "StatsRequest",
    "OutputsDropped",
    "TokenBatch",
    "TokenLogprobs",
    "TokenOutput",
]
