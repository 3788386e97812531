"""The model runner of a disaggregated engine: ships prefill KV, and sends decode attention to
attention shards.

Prefill (prompt role): each layer's k/v go to `KvShipper.on_layer` (kv_shipper.py) when the
request decodes elsewhere.

Decode (token role): a batch is `[local rows | sharded rows]`. Per layer the sharded rows' q/k/v go
to every shard of the group first (one message per shard, that shard's heads, the whole batch;
shard_round_trip.py); local attention runs while the shards work; then the shards' outputs are
collected (Lamina). Variants, each a switch: q before k/v (`attention_overlap`, Lamina §4.2.2),
staggered lanes (`decode_lanes`, §4.3, lanes.py), a request-partitioned group (each shard only its
requests' rows), and Neo's two sub-batches (`StepPlan.batch_1`, Neo §3.1).

Everything a step needs beyond its tensors travels in its `StepPlan`, and what a decode step learns
beside its logits comes back in its `StepResult` (the engine plans, the runner runs, the engine
applies the result): the runner keeps no per-step state, and its options are set once, when built.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from common.attention.prefix_prefill import with_cached_prefixes
from common.device import HostStaging, StagedCopy
from common.engine.runner import ModelRunner, StepInputs, pad_block_tables
from common.model.llama import RopeAt
from common.protocol import (
    ATTEND_NEW,
    ATTEND_PREV,
    ATTEND_WHOLE,
    ShardAddress,
    SliceRequest,
)
from common.scheduling.batching import Batch, Phase, Sequence
from services.engine.kv_shipper import KvShipper
from services.engine.lanes import AutoLanes, LaneRun, run_lanes, split_lanes
from services.engine.model_peer import run_slice
from services.engine.rotation import ModelPeers, SliceInFlight
from services.engine.shard_round_trip import (
    DecodeTimes,
    LayerInFlight,
    ShardedRows,
    ShardLink,
    ShardLinkFault,
    ShardLost,
    ShardSend,
    ask_kv_news,
    collect_layer,
    send_by_request,
    send_layer,
)

# How long a decode step waits for a shard's reply to one layer before it gives the link up: a
# stopped or partitioned shard must not hang its token engine (docs/failures.md).
SHARD_REPLY_TIMEOUT_S = 30.0


@dataclass
class StepPlan(StepInputs):
    """One step's inputs and where its attention goes.

    Prefill: `kv_shipper` (if any) sends each layer's k/v on. Decode: rows `[0, num_local)` attend
    over this engine's cache, `sharded` (if any) on the shard group; `trace_round_trips` asks for
    each shard's round-trip times (telemetry). Neo's asymmetric pipelining (§3.1): `batch_1` holds
    the offloaded rows and this plan the local ones, run interleaved per layer; logits come back
    as [batch-0 rows | batch-1 rows].
    """

    num_local: int = 0
    sharded: ShardedRows | None = None
    kv_shipper: KvShipper | None = None
    trace_round_trips: bool = False
    batch_1: StepPlan | None = None


@dataclass
class StepResult:
    """A decode step's logits and what its shards said beside them: the sharded requests a shard
    could not attend for (`failed`: their tokens are meaningless, each ends alone), the shards'
    news about KV arriving (`kv_landed`: shard index and request ids; `kv_lost`), and, when the
    plan asked, (shard index, seconds from send to reply) per shard and layer."""

    logits: torch.Tensor
    failed: set[str] = field(default_factory=set)
    kv_landed: list[tuple[int, list[str]]] = field(default_factory=list)
    kv_lost: set[str] = field(default_factory=set)
    round_trips: list[tuple[int, float]] | None = None


class MeshModelRunner(ModelRunner[StepPlan]):
    """`ModelRunner` whose attention stage ships KV (prefill) or visits shards (decode)."""

    def __init__(
        self,
        *args: Any,
        shard_links: Seq[ShardLink] = (),
        shards: Seq[ShardAddress] = (),
        reply_timeout_s: float = SHARD_REPLY_TIMEOUT_S,
        attention_overlap: bool = False,
        decode_lanes: int | Literal["auto"] = 1,
        **kwargs: Any,
    ) -> None:
        """`shard_links[i]` reaches `shards[i]`, the group's members in head order.
        `attention_overlap`: q goes to the shards before k/v are computed (Lamina 4.2.2, two
        messages per layer). `decode_lanes`: a decode step's sharded rows run as this many
        staggered lanes (Lamina 4.3, lanes.py); `auto` starts at one and chooses from the steps'
        breakdown (`AutoLanes`)."""
        super().__init__(*args, **kwargs)
        self.shard_links = list(shard_links)
        self.shards = list(shards)
        self.reply_timeout_s = reply_timeout_s
        self.attention_overlap = attention_overlap
        if attention_overlap:  # early q's halves packed now, not in the first decode step
            for layer in self.model.layers:
                layer.pack_halves()
        self.auto_lanes = AutoLanes(len(self.model.layers)) if decode_lanes == "auto" else None
        self.decode_lanes = 1 if decode_lanes == "auto" else decode_lanes
        self.times = DecodeTimes()  # sharded decode steps' breakdown (Lamina Fig. 12)
        # Lamina 4.3 across replicas: lanes' layer slices rotate over these peers (rotation.py).
        self.model_peers: ModelPeers | None = None
        self.num_relinks = 0  # shard group changes since start (a fault, a `LinkShards`)
        # Lamina's split on a device engine: what goes to host shards (q/k/v, shipped KV) leaves
        # device memory through pinned buffers and the replies come back the same way; on the
        # CPU the identity, skipped (`on_device` is read once per layer's send).
        self.staging = HostStaging(self.device)

    def use_peers(self, peers: ModelPeers) -> None:
        """Rotate lanes' layer slices over `peers` from the next step on (Lamina 4.3; linked
        after start: on Ray the peers may still be starting)."""
        self.model_peers = peers

    def relink(self, links: Seq[ShardLink], shards: Seq[ShardAddress]) -> None:
        """Decode against `shards` through `links` from the next step on (empty: local only)."""
        self.shard_links, self.shards = list(links), list(shards)
        self.num_relinks += 1

    def plan_prefill(
        self, batch: Batch, token_ids: Mapping[str, Seq[int]], kv_shipper: KvShipper | None = None
    ) -> StepPlan:
        """A prefill step; its KV also goes to `kv_shipper` when the request decodes elsewhere."""
        return StepPlan(**self.prepare(batch, token_ids).fields(), kv_shipper=kv_shipper)

    def plan_decode(
        self,
        local: list[Sequence],
        sharded: list[Sequence],
        token_ids: Mapping[str, Seq[int]],
        step: int,
        traceparent: str = "",
        shard_of: list[int] | None = None,
        two_batches: bool = False,
        trace_round_trips: bool = False,
    ) -> StepPlan:
        """A decode step over `[local rows | sharded rows]`; only local rows get slots and block
        tables. `shard_of`: a request-partitioned group's shard of each sharded row.
        `two_batches`: Neo's sub-batches, the local rows and the sharded ones interleaved per
        layer (head-split groups with both kinds of rows only; otherwise one batch).
        `trace_round_trips`: the result carries the shards' round-trip times (telemetry)."""
        if two_batches and local and sharded and shard_of is None:
            plan = self._decode_rows(local, [], token_ids, step, "", None)
            plan.batch_1 = self._decode_rows([], sharded, token_ids, step, traceparent, None)
        else:
            plan = self._decode_rows(local, sharded, token_ids, step, traceparent, shard_of)
        plan.trace_round_trips = trace_round_trips
        return plan

    def _decode_rows(
        self,
        local: list[Sequence],
        sharded: list[Sequence],
        token_ids: Mapping[str, Seq[int]],
        step: int,
        traceparent: str,
        shard_of: list[int] | None,
    ) -> StepPlan:
        seqs = local + sharded
        req_ids = [s.req_id for s in seqs]
        positions = [s.num_tokens - 1 for s in seqs]
        slots = [self.blocks.slot(s.req_id, s.num_tokens - 1) for s in local]
        rows = ShardedRows(
            step, req_ids[len(local) :], [s.num_tokens for s in sharded], traceparent
        )
        if shard_of is not None:
            rows.shard_rows = [[r for r, s in enumerate(shard_of) if s == i]
                               for i in range(len(self.shard_links))]  # fmt: skip
        plan = StepPlan(
            phase=Phase.DECODE,
            req_ids=req_ids,
            input_ids=torch.tensor(
                [token_ids[r][p] for r, p in zip(req_ids, positions, strict=True)]
            ),
            positions=torch.tensor(positions),
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            seq_lens=[1] * len(seqs),
            block_tables=pad_block_tables([self.blocks.block_table(s.req_id) for s in local]),
            context_lens=torch.tensor([s.num_tokens for s in local], dtype=torch.int32),
            last_token_index=torch.arange(len(seqs)),
            num_local=len(local),
            sharded=rows if sharded else None,
        )
        return self.place(plan)

    @torch.inference_mode()
    def run_decode(self, plan: StepPlan) -> StepResult:
        """A decode step. Sharded rows run as lanes when overlap, staggering or model peers are
        on, or as Neo's two sub-batches when the plan has a `batch_1`."""
        result = StepResult(torch.empty(0), round_trips=[] if plan.trace_round_trips else None)
        if plan.sharded is None and plan.batch_1 is None:
            result.logits = self.run(plan)
            return result
        started = time.perf_counter()
        if plan.batch_1 is not None:
            result.logits = self._run_two_batches(plan, plan.batch_1, result)
        elif not self.attention_overlap and self.decode_lanes == 1 and not self._rotates(plan):
            result.logits = self._run_one_lane(plan, result)
        else:
            result.logits = self._run_lanes(plan, result)
        self.times.num_steps += 1
        self.times.step_s += time.perf_counter() - started
        if self.auto_lanes is not None:
            num_peers = len(self.model_peers) if self.model_peers is not None else 0
            self.decode_lanes = self.auto_lanes.lanes(self.times, num_peers)
        return result

    def _run_one_lane(self, plan: StepPlan, result: StepResult) -> torch.Tensor:
        """Every layer's round trip in one piece: local rows attend while the shards work."""
        assert plan.sharded is not None
        x = self.model.embed(plan.input_ids)  # [N, hidden]
        rope = self.model.rotary_at(plan.positions)
        for i, layer in enumerate(self.model.layers):
            q, k, v = layer.pre_attention(x, rope)  # [N, H, D]
            x = layer.post_attention(x, self._attend_sharded(i, q, k, v, plan, result))
        self.hidden = None
        return self.model.compute_logits(x)  # [N, vocab]

    def _run_two_batches(
        self, batch_0: StepPlan, batch_1: StepPlan, result: StepResult
    ) -> torch.Tensor:
        """Per layer: batch-1's q/k/v go to the shards first, batch-0's whole layer (dense work
        and local attention) runs while the shards attend, then batch-1's replies finish its
        layer. Each row goes through the same math as in the one-batch step."""
        assert batch_1.sharded is not None
        x0, x1 = self.model.embed(batch_0.input_ids), self.model.embed(batch_1.input_ids)
        rope0, rope1 = (
            self.model.rotary_at(batch_0.positions),
            self.model.rotary_at(batch_1.positions),
        )
        for i, layer in enumerate(self.model.layers):
            q1, k1, v1 = layer.pre_attention(x1, rope1)  # [N1, H, D]
            if self.staging.on_device:  # batch-0's dense work runs while batch-1's copies do
                staged = self.staging.stage(q1, k1, v1)
                q0, k0, v0 = layer.pre_attention(x0, rope0)
                sends = self._send_staged(i, batch_1.sharded, ATTEND_WHOLE, True, staged)
            else:
                sends = self._send(i, batch_1.sharded, ATTEND_WHOLE, q1, (k1, v1))
                q0, k0, v0 = layer.pre_attention(x0, rope0)
            flight = LayerInFlight(sends, self.staging.host_buffer(q1.shape, torch.float32), 0)
            x0 = layer.post_attention(x0, super().attend(i, q0, k0, v0, batch_0))
            self._collect(flight, result)
            x1 = layer.post_attention(x1, flight.out)
        self.hidden = None
        return self.model.compute_logits(torch.cat([x0, x1]))  # [N0 + N1, vocab]

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: StepPlan
    ) -> torch.Tensor:
        """A prefill's attention (its KV shipped on, when it decodes elsewhere), or a decode
        step's with local rows only; sharded rows go through `run_decode`."""
        out = super().attend(layer, q, k, v, inputs)
        if inputs.phase is Phase.PREFILL and inputs.kv_shipper is not None:
            # The receiver needs the whole prompt's KV, cached prefix included.
            k_all, v_all, lens = with_cached_prefixes(
                k, v, self.kv_cache.key[layer], self.kv_cache.value[layer], inputs.seq_lens,
                inputs.prefix_lens, inputs.block_tables,
            )  # fmt: skip
            if self.staging.on_device:  # it lands in host memory (a shard's, or a host's link)
                k_all, v_all = self.staging.to_host(k_all, v_all)
            inputs.kv_shipper.on_layer(layer, k_all, v_all, lens)
        return out

    def _attend_sharded(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: StepPlan,
        result: StepResult,
    ) -> torch.Tensor:
        """One layer's round trip as one message per shard, local rows meanwhile: each shard
        a slice of heads of every row, or (a request-partitioned group) its requests' rows."""
        assert plan.sharded is not None
        n, rows = plan.num_local, plan.sharded
        if rows.shard_rows is not None:
            if self.staging.on_device:
                q, k, v = self.staging.to_host(q, k, v)
            sends = send_by_request(self.shard_links, layer, rows, q, k, v, n)
        elif self.staging.on_device:
            return self._attend_sharded_on_device(layer, (q, k, v), plan, result)
        else:
            sends = self._send(layer, rows, ATTEND_WHOLE, q[n:], (k[n:], v[n:]))
        flight = LayerInFlight(sends, self._attend_rows_local(layer, q, k, v, plan, n), n)
        self._collect(flight, result)
        return flight.out

    def _attend_sharded_on_device(
        self, layer: int, qkv: tuple[torch.Tensor, ...], plan: StepPlan, result: StepResult
    ) -> torch.Tensor:
        """`_attend_sharded` on a device engine: the sharded rows' copies to the host are queued,
        the local rows' attention is queued behind them on the engine's stream (so it runs while
        they copy, and its output never leaves the device), then the copies are waited for and
        sent; the replies come back into the rows after the local ones."""
        assert plan.sharded is not None
        n, (q, k, v) = plan.num_local, qkv
        staged = self.staging.stage(q[n:], k[n:], v[n:])
        local = self._attend_local(layer, q[:n], k[:n], v[:n], plan) if n else None
        sends = self._send_staged(layer, plan.sharded, ATTEND_WHOLE, True, staged)
        flight = LayerInFlight(sends, self.staging.host_buffer(q.shape, torch.float32), n)
        self._collect(flight, result)
        if local is not None:
            flight.out[:n] = local
        return flight.out

    def _rotates(self, inputs: StepPlan) -> bool:
        """Whether the step's lanes rotate over model peers (head-split groups only)."""
        sharded = inputs.sharded
        return bool(self.model_peers) and sharded is not None and sharded.shard_rows is None

    def _run_lanes(self, inputs: StepPlan, result: StepResult) -> torch.Tensor:
        assert inputs.sharded is not None
        if self.model_peers is not None:
            self.model_peers.prune()
        x = self.model.embed(inputs.input_ids)  # [N, hidden]
        rope = self.model.rotary_at(inputs.positions)
        rows = inputs.sharded
        lanes = []
        for lane in split_lanes(inputs.num_local, len(rows.req_ids), self.decode_lanes):
            a, b, c, d = lane.start, lane.end, lane.sharded_start, lane.sharded_end
            traceparent = rows.traceparent if lane.lane == 0 else ""  # shards trace lane 0
            lane_rows = ShardedRows(
                rows.step, rows.req_ids[c:d], rows.context_lens[c:d], traceparent, lane.lane
            )
            lane_rope = rope._replace(positions=rope.positions[a:b])
            lanes.append(self._lane(x[a:b], lane_rope, inputs, result, lane_rows, lane.num_local))
        self.hidden = None
        return self.model.compute_logits(torch.cat(run_lanes(lanes, self._drain)))

    def _lane(
        self,
        x: torch.Tensor,
        rope: RopeAt,
        inputs: StepPlan,
        result: StepResult,
        rows: ShardedRows,
        n: int,
    ) -> LaneRun:
        """One lane's layers (lanes.py): its first `n` rows attend locally, the rest on shards.
        With `attention_overlap`, q leaves before k/v are computed (Lamina 4.2.2). With model
        peers, some of its slices run on them (rotation.py): it yields while a peer works."""
        out: torch.Tensor | None = None  # the previous layer's attention output
        for i in range(len(self.model.layers)):
            on_peer = None
            peer = self.model_peers.peer_of(rows.lane, i) if self.model_peers else None
            if peer is not None and self.model_peers is not None:
                request = SliceRequest(rows.step, rows.lane, i)
                flight_to_peer = self.model_peers.send(peer, request, x, rope.positions, out)
                if flight_to_peer is not None:
                    yield flight_to_peer  # another lane runs while the peer runs this slice
                    on_peer = self.model_peers.receive(flight_to_peer)
            if on_peer is not None:
                x, q, k, v = on_peer
                sends = self._send(i, rows, ATTEND_WHOLE, q[n:], (k[n:], v[n:]))
            else:
                x, q, k, v, sends = self._local_slice(i, x, rope, out, rows, n)
            flight = LayerInFlight(sends, self._attend_rows_local(i, q, k, v, inputs, n), n)
            yield flight  # another lane's dense part runs while the shards work
            self._collect(flight, result)
            out = flight.out
        assert out is not None
        return self.model.layers[-1].post_attention(x, out)

    def _local_slice(
        self,
        layer: int,
        x: torch.Tensor,
        rope: RopeAt,
        out: torch.Tensor | None,
        rows: ShardedRows,
        n: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[ShardSend]]:
        """A lane's slice `layer` here (model_peer.py's `run_slice`), its q/k/v sent on."""
        if not self.attention_overlap:
            x, q, k, v = run_slice(self.model, layer, x, rope, out)
            return x, q, k, v, self._send(layer, rows, ATTEND_WHOLE, q[n:], (k[n:], v[n:]))
        if out is not None:
            x = self.model.layers[layer - 1].post_attention(x, out)
        h, q = self.model.layers[layer].pre_attention_q(x, rope)  # q [rows, Hq, D]
        sends = self._send(layer, rows, ATTEND_PREV, q[n:], ())
        k, v = self.model.layers[layer].pre_attention_kv(h, rope)  # the shards attend meanwhile
        sends += self._send(layer, rows, ATTEND_NEW, None, (k[n:], v[n:]))
        return x, q, k, v, sends

    def _send(
        self,
        layer: int,
        rows: ShardedRows,
        part: int,
        q: torch.Tensor | None,
        kv: tuple[torch.Tensor, ...],
    ) -> list[ShardSend]:
        """`send_layer` to this engine's shard group (the model's query heads per KV head)."""
        if self.staging.on_device:
            staged = self.staging.stage(*kv) if q is None else self.staging.stage(q, *kv)
            return self._send_staged(layer, rows, part, q is not None, staged)
        group = self.model.config.num_queries_per_kv
        return send_layer(self.shard_links, self.shards, layer, rows, part, group, q, kv)

    def _send_staged(
        self, layer: int, rows: ShardedRows, part: int, with_q: bool, staged: StagedCopy
    ) -> list[ShardSend]:
        """`_send` of copies `HostStaging.stage` queued (q first when `with_q`, then k/v), once
        they are in host memory."""
        host = staged.wait()
        q, kv = (host[0], tuple(host[1:])) if with_q else (None, tuple(host))
        group = self.model.config.num_queries_per_kv
        return send_layer(self.shard_links, self.shards, layer, rows, part, group, q, kv)

    def _collect(self, flight: LayerInFlight, result: StepResult) -> None:
        """The shards' replies into `flight.out` (host memory), then `flight.out` on this
        engine's device (the same tensor on the CPU)."""
        collect_layer(flight, self.reply_timeout_s, result.failed, result.round_trips, self.times,
                      (result.kv_landed, result.kv_lost))  # fmt: skip
        flight.out = self.staging.to_device(flight.out)

    def _attend_rows_local(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        inputs: StepPlan,
        n: int,
    ) -> torch.Tensor:
        """out [rows, Hq, D] float32 in host memory (the shards' replies land there), its first
        `n` rows attended over this engine's cache."""
        out = self.staging.host_buffer(q.shape, torch.float32)
        if n:
            out[:n] = self._attend_local(layer, q[:n], k[:n], v[:n], inputs)
        return out

    def ask_kv_news(
        self, step: int, wait_s: float, shards: Seq[int] | None = None
    ) -> tuple[list[tuple[int, list[str]]], set[str]]:
        """Between steps: news about KV arriving from `shards` (indexes; all by default), a
        `KvReadyQuery` round trip each; a shard with none waits up to `wait_s` for some."""
        asked = range(len(self.shard_links)) if shards is None else shards
        return ask_kv_news(self.shard_links, step, wait_s, self.reply_timeout_s, asked)

    def _drain(self, in_flight: object, error: BaseException) -> None:
        """Another lane failed: read this lane's replies still on the links. Not after a link
        fault: the worker drops the links, and their stale replies with them. After a lost shard
        (`ShardLost`) the survivors' links stay (their KV is kept), so their replies are read."""
        # NOTE: another ConnectionError: a link's channel closed; the worker drops the group.
        if isinstance(in_flight, SliceInFlight):  # peer links stay: their replies are read
            assert self.model_peers is not None
            self.model_peers.receive(in_flight)
            return
        if isinstance(error, ShardLinkFault) or (
            isinstance(error, ConnectionError) and not isinstance(error, ShardLost)
        ):
            return
        assert isinstance(in_flight, LayerInFlight)  # what `_lane` yields
        try:
            collect_layer(in_flight, self.reply_timeout_s, set())
        except Exception:  # noqa: BLE001 - the first lane's error is the one raised
            pass

    def _attend_local(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: StepPlan
    ) -> torch.Tensor:
        n = inputs.num_local
        self.kv_cache.write(layer, k, v, inputs.slot_mapping[:n])
        out, _ = self.backend.decode(
            q,
            self.kv_cache.key[layer],
            self.kv_cache.value[layer],
            inputs.block_tables[:n],
            inputs.context_lens[:n],
            self.model.scale,
        )
        return out
