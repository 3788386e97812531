"""One decode layer's round trip from a token engine to its shard group: the sends, the replies,
and the time each side spent (Lamina Fig. 12's breakdown).

A layer goes to every shard as one message (q, k, v: ATTEND_WHOLE) or, with overlap (Lamina
4.2.2), as two (q: ATTEND_PREV, then k/v: ATTEND_NEW); either way each shard answers once. The
runner (runner.py) decides what to send when; this module only moves and checks the messages.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from common.protocol import (
    ATTEND_NEW,
    ATTEND_PREV,
    AttendBatch,
    AttendResult,
    DecodeBreakdown,
    KvReadyQuery,
    ShardAddress,
)
from common.transport.tensor_frames import TensorLink
from common.transport.ucx_channel import ChannelClosed


class ShardLink(TensorLink, Protocol):
    """A token engine's connection to one attention shard (UCX or ZeroMQ underneath)."""

    def close(self) -> None: ...


class ShardLinkFault(RuntimeError):
    """A shard link can no longer be trusted: a reply did not come in time, or came for another
    step, layer or lane. Its worker reconnects the group (stale replies go with the old channel)."""


class ShardLost(ChannelClosed):
    """Shards of the group went away mid-step (their links closed), `shards` by index. Every
    other shard's reply to the step's layers was read, so the survivors' links stay in step and
    their KV can be kept (a head-split group's rebuild, Lamina §5)."""

    def __init__(self, shards: set[int]) -> None:
        super().__init__(f"shard link closed: shards {sorted(shards)} of the group")
        self.shards = shards


@dataclass
class ShardedRows:
    """The decode rows whose KV lives on the shard group, at the end of the batch (or of a
    lane's rows, lanes.py)."""

    step: int
    req_ids: list[str]
    context_lens: list[int]
    traceparent: str = ""  # the step's `token.step` context when traced, for the shards
    lane: int = 0  # which of the step's lanes these rows are (lanes.py)
    # A group that holds whole requests (`shard_partition: request`): per shard, the indexes of
    # the rows (into `req_ids`) whose KV it holds; None: heads split, every shard every row.
    shard_rows: list[list[int]] | None = None


@dataclass
class ShardSend:
    """One message of a layer to one shard; `replied`: the shard answers this one."""

    shard: int
    link: ShardLink
    heads: slice  # the shard's query heads
    handle: Any
    sent_at: float
    rows: ShardedRows
    layer: int
    replied: bool = True
    # A request-partitioned group: the batch rows this shard got (all heads), gathered; its
    # reply is scattered back to them. None: the shard got every row, `heads` of them.
    row_index: torch.Tensor | None = None
    closed: bool = False  # its send found the link closed (no reply will come)


@dataclass
class LayerInFlight:
    """A lane's layer between its sends and its replies: what `collect_layer` needs."""

    sends: list[ShardSend]
    out: torch.Tensor  # [rows, Hq, D] float32: the replies land in rows [num_local:]
    num_local: int


@dataclass
class DecodeTimes:
    """Seconds a token engine's sharded decode steps spent, summed since start: the step, the
    engine blocked on replies (idle), and per layer the slowest shard's attention and the rest of
    its round trip (network, queueing included). Overlap makes them sum to more than the step."""

    num_steps: int = 0
    step_s: float = 0.0
    wait_s: float = 0.0
    attend_s: float = 0.0
    network_s: float = 0.0

    def add_layer(self, wait_s: float, attend_s: float, network_s: float) -> None:
        self.wait_s, self.attend_s = self.wait_s + wait_s, self.attend_s + attend_s
        self.network_s += network_s

    def report(self) -> DecodeBreakdown:
        return DecodeBreakdown(
            self.num_steps, self.step_s, self.wait_s, self.attend_s, self.network_s
        )


def send_layer(
    links: Seq[ShardLink],
    shards: Seq[ShardAddress],
    layer: int,
    rows: ShardedRows,
    part: int,
    group: int,
    q: torch.Tensor | None,
    kv: tuple[torch.Tensor, ...],
) -> list[ShardSend]:
    """One message per shard with that shard's heads of q [rows, Hq, D] (if any) and of each of
    `kv` [rows, Hkv, D]; `group` query heads per KV head."""
    sent = []
    for i, (link, shard) in enumerate(zip(links, shards, strict=True)):
        h0, h1 = shard.head_start, shard.head_end
        header = AttendBatch(rows.step, layer, part=part, lane=rows.lane)
        if layer == 0 and part != ATTEND_NEW:
            header.req_ids, header.context_lens = rows.req_ids, rows.context_lens
            header.traceparent = rows.traceparent
        # Strided slices: the channel copies each straight into the message, once.
        q_heads = slice(h0 * group, h1 * group)
        buffers = ([] if q is None else [q[:, q_heads]]) + [t[:, h0:h1] for t in kv]
        handle, closed = None, False
        try:
            handle = link.send_async(header, buffers)
        except ChannelClosed:  # the others still get theirs: their replies are read in step
            closed = True
        sent.append(ShardSend(i, link, q_heads, handle, time.perf_counter(), rows, layer,
                              replied=part != ATTEND_PREV, closed=closed))  # fmt: skip
    return sent


def send_by_request(
    links: Seq[ShardLink],
    layer: int,
    rows: ShardedRows,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_local: int,
) -> list[ShardSend]:
    """A request-partitioned group's layer: each shard gets only its requests' rows of q, k, v
    [rows, heads, D] (all heads; `rows.shard_rows`, batch rows from `num_local` on); a shard with
    none this step gets no message (it holds no state between steps)."""
    assert rows.shard_rows is not None
    sends = []
    for i, (link, shard_rows) in enumerate(zip(links, rows.shard_rows, strict=True)):
        if not shard_rows:
            continue
        header = AttendBatch(rows.step, layer)
        if layer == 0:
            header.req_ids = [rows.req_ids[r] for r in shard_rows]
            header.context_lens = [rows.context_lens[r] for r in shard_rows]
            header.traceparent = rows.traceparent
        index = torch.tensor(shard_rows) + num_local  # [R] rows of the batch
        handle = link.send_async(header, [q[index], k[index], v[index]])  # [R, heads, D]
        sends.append(ShardSend(i, link, slice(None), handle, time.perf_counter(), rows, layer,
                               row_index=index))  # fmt: skip
    return sends


def collect_layer(
    flight: LayerInFlight,
    timeout: float,
    failed: set[str],
    round_trips: list[tuple[int, float]] | None = None,
    times: DecodeTimes | None = None,
    kv_news: tuple[list[tuple[int, list[str]]], set[str]] | None = None,
) -> None:
    """Each shard's reply to a layer: its heads land in place in `flight.out[num_local:]`; the
    requests a shard could not attend for go to `failed`; the shards' news of KV that landed
    (shard index, request ids) and was lost go to `kv_news` (`AttendResult.kv_landed`). Raises
    `ShardLinkFault` for a reply that did not come, does not fit or answers something else,
    RuntimeError for a shard's error, `ShardLost` for links that closed (the others' replies
    read all the same)."""
    out, n = flight.out, flight.num_local
    started = time.perf_counter()
    attend_s = network_s = 0.0
    # Every shard's reply is read before anything is raised: one left queued would be taken for
    # the next step's. Each reply must answer this step, layer and lane; anything else is a fault
    # of the link, never data. With overlap, each shard got two messages and sends one reply.
    errors, faults, lost = [], [], set()
    for sent in flight.sends:
        try:
            reply = _receive_reply(sent, out, n, timeout)
        except ChannelClosed:
            lost.add(sent.shard)
            continue
        except TimeoutError:
            faults.append(f"shard {sent.shard}: no reply in {timeout} s")
            continue
        except ValueError as exc:  # malformed, or buffers of other shapes (another version?)
            faults.append(f"shard {sent.shard}: reply does not fit: {exc}")
            continue
        if reply is None:  # an ATTEND_PREV: its ATTEND_NEW gets the reply
            continue
        result, rows_out = reply
        round_trip = time.perf_counter() - sent.sent_at
        attend_s = max(attend_s, result.attend_s)
        network_s = max(network_s, round_trip - result.attend_s)
        if round_trips is not None:
            round_trips.append((sent.shard, round_trip))
        if (fault := _answers_something_else(sent, result)) is not None:
            faults.append(fault)
        elif result.error:
            errors.append(f"shard {sent.shard}: {result.error}")
        elif rows_out is not None:
            out[sent.row_index] = rows_out
        failed.update(result.failed)
        if kv_news is not None and (result.kv_landed or result.kv_lost):
            kv_news[0].append((sent.shard, result.kv_landed))
            kv_news[1].update(result.kv_lost)
    if times is not None:
        times.add_layer(time.perf_counter() - started, attend_s, network_s)
    if faults:
        raise ShardLinkFault("; ".join(faults))
    if lost:
        raise ShardLost(lost)
    if errors:
        raise RuntimeError(f"attention shard failed: {'; '.join(errors)}")


def _answers_something_else(sent: ShardSend, result: AttendResult) -> str | None:
    """What is wrong with a reply that answers another step, layer or lane than `sent`'s."""
    step, layer, lane = sent.rows.step, sent.layer, sent.rows.lane
    if (result.step, result.layer, result.lane) == (step, layer, lane):
        return None
    return (f"shard {sent.shard}: reply for step {result.step} layer {result.layer} lane "
            f"{result.lane}, expected step {step} layer {layer} lane {lane}")  # fmt: skip


def _receive_reply(
    sent: ShardSend, out: torch.Tensor, num_local: int, timeout: float
) -> tuple[AttendResult, torch.Tensor | None] | None:
    """`sent`'s reply once its send is done: its heads landed in place in `out[num_local:]`, or
    (a request-partitioned group) with its rows' output to scatter; None for an ATTEND_PREV."""
    if sent.closed:
        raise ChannelClosed(f"shard {sent.shard}: link closed")
    sent.link.wait(sent.handle, timeout)
    if not sent.replied:
        return None
    if sent.row_index is None:  # no staging
        result, _ = sent.link.recv([out[num_local:, sent.heads]], timeout)
        return result, None
    result, (rows_out,) = sent.link.recv(None, timeout)
    return result, rows_out


def ask_kv_news(
    links: Seq[ShardLink], step: int, wait_s: float, timeout: float, asked: Iterable[int]
) -> tuple[list[tuple[int, list[str]]], set[str]]:
    """Between steps: news about KV arriving from the shards `asked` (indexes into `links`), a
    `KvReadyQuery` round trip each; a shard with none waits up to `wait_s` for some. Raises
    `ShardLinkFault` for an answer that did not come or answers something else."""
    asked = list(asked)
    for i in asked:
        link = links[i]
        link.wait(link.send_async(KvReadyQuery(step, wait_s), []), timeout)
    landed, lost = [], set()
    for i in asked:
        link = links[i]
        try:
            result, _ = link.recv(None, timeout)
        except TimeoutError as exc:
            raise ShardLinkFault(f"shard {i}: no answer about its KV") from exc
        if (result.step, result.layer) != (step, -1):
            raise ShardLinkFault(f"shard {i}: answered step {result.step} layer "
                                 f"{result.layer} to a KV query of step {step}")  # fmt: skip
        landed.append((i, result.kv_landed))
        lost.update(result.kv_lost)
    return landed, lost


__all__ = [
    "DecodeTimes",
    "LayerInFlight",
    "ShardLink",
    "ShardLinkFault",
    "ShardLost",
    "ShardSend",
    "ShardedRows",
    "ask_kv_news",
    "collect_layer",
    "send_by_request",
    "send_layer",
]
