"""Lamina's decode round trip variants in one process: early q (4.2.2: the shard attends over the
previous tokens, then appends the new token's k/v and combines by lse) and staggered lanes (4.3:
a step's sharded rows as n = 2 or 3 sub-batches interleaved per layer). The token engine's runner
talks to real `AttentionShard`s through in-memory links that answer as `services/shard/worker.py`
does; every variant must give the logits of the single-process runner (greedy tokens equal). The
real UCX path is covered by tests/integration/test_mesh_parity.py."""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest
import torch

from common.attention import select_backend
from common.block_manager import BlockManager
from common.engine.runner import ModelRunner
from common.kv_cache import KVCache
from common.model.loader import load_model
from common.protocol import (
    ATTEND_NEW,
    ATTEND_PREV,
    AttendBatch,
    AttendResult,
    KvPages,
    ShardAddress,
)
from common.scheduling.batching import Batch, Phase, Sequence
from common.scheduling.lane_choice import MeasuredSteps
from services.engine.kv_shipper import KvRoute, KvShipper
from services.engine.lanes import AutoLanes, split_lanes
from services.engine.runner import MeshModelRunner, ShardLinkFault
from services.shard.shard import AttentionShard, ShardSpec
from tests.conftest import random_prompts

LENGTHS = [5, 19, 33, 2, 40]
NUM_STEPS = 6


class InProcessLink:
    """A shard link answering in-process, part by part, as the shard worker does; `fail_lane`
    makes the shard's answers to that lane errors."""

    def __init__(
        self, shard: AttentionShard, fail_lane: int | None = None, lane_swap: bool = False
    ) -> None:
        self.shard, self.fail_lane, self.lane_swap = shard, fail_lane, lane_swap
        self.replies: deque[tuple[AttendResult, list[torch.Tensor]]] = deque()
        self.parts: list[tuple[int, int, int]] = []  # (lane, layer, part) in arrival order

    def send_async(self, header: AttendBatch, tensors: list[torch.Tensor]) -> None:
        bufs = [t.contiguous().clone() for t in tensors]
        self.parts.append((header.lane, header.layer, header.part))
        if header.part == ATTEND_PREV:
            self.shard.attend_prev(header, bufs[0])
            return
        if header.part == ATTEND_NEW:
            out, _, failed = self.shard.attend_new(header, *bufs)
        else:
            out, _, failed = self.shard.attend(header, *bufs)
        error = "boom" if header.lane == self.fail_lane else ""
        lane = 1 - header.lane if self.lane_swap else header.lane  # a link gone wrong
        reply = AttendResult(header.step, header.layer, error, failed, lane=lane)
        self.replies.append((reply, [out]))

    def wait(self, handle: Any, timeout: float | None = None) -> None:
        pass

    def recv(self, out: Any = None, timeout: float | None = None) -> tuple[AttendResult, list]:
        reply, tensors = self.replies.popleft()
        for target, tensor in zip(out, tensors, strict=True):
            target.copy_(tensor)
        return reply, out


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return load_model(tiny_model_path)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(LENGTHS, 2048, seed=5)


@pytest.fixture(scope="module")
def local(model, prompts) -> tuple[list[list[int]], list[torch.Tensor]]:
    return greedy_local(model, prompts)


def make_runner(model, cls=ModelRunner, **kwargs):
    mc = model.config
    kv = KVCache(mc.num_hidden_layers, 64, 16, mc.num_key_value_heads, mc.head_dim, torch.float32)
    return cls(model, kv, BlockManager(64, 16), select_backend("auto"), **kwargs)


def greedy_local(model, prompts) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The single-process runner's greedy tokens and each decode step's logits."""
    runner = make_runner(model)
    tokens = {f"r{i}": list(p) for i, p in enumerate(prompts)}
    seqs = [Sequence(r, len(t)) for r, t in tokens.items()]
    for s in seqs:
        runner.blocks.allocate(s.req_id, s.num_tokens + NUM_STEPS + 1)
    logits = runner.run(runner.prepare(Batch(Phase.PREFILL, seqs), tokens))
    steps = []
    for _ in range(NUM_STEPS):
        for s, t in zip(seqs, logits.argmax(-1).tolist(), strict=True):
            tokens[s.req_id].append(t)
            s.num_computed, s.num_tokens = s.num_tokens, s.num_tokens + 1
        logits = runner.run(runner.prepare(Batch(Phase.DECODE, seqs), tokens))
        steps.append(logits)
    return [tokens[s.req_id] for s in seqs], steps


def greedy_sharded(model, prompts, overlap: bool, lanes: int, fail_lane: int | None = None,
                   links: list[InProcessLink] | None = None, lane_swap: bool = False,
                   auto_lanes: AutoLanes | None = None, model_peers=None,
                   between_steps=None):  # fmt: skip
    """The same with every request's KV on two head-split shards, decoding through the runner's
    round trips with `attention_overlap` and `decode_lanes` as given (into `links`, if given);
    `between_steps(step)`, if given, runs before each decode step (as a worker's drain)."""
    mc = model.config
    half = mc.num_key_value_heads // 2
    spec = dict(num_layers=mc.num_hidden_layers, num_queries_per_kv=mc.num_queries_per_kv,
                head_dim=mc.head_dim, num_blocks=64, block_size=16, dtype=torch.float32,
                scale=mc.head_dim**-0.5)  # fmt: skip
    backend = select_backend("auto")
    shards = [
        AttentionShard("s0", ShardSpec(head_start=0, head_end=half, **spec), backend),
        AttentionShard("s1", ShardSpec(head_start=half, head_end=mc.num_key_value_heads, **spec),
                       backend),
    ]  # fmt: skip
    addresses = [ShardAddress("s0", 0, half), ShardAddress("s1", half, mc.num_key_value_heads)]
    links = links if links is not None else []
    links += [InProcessLink(s, fail_lane, lane_swap) for s in shards]
    runner = make_runner(model, MeshModelRunner, shard_links=links, shards=addresses,
                         attention_overlap=overlap, decode_lanes=lanes)  # fmt: skip
    runner.auto_lanes = auto_lanes  # a test's own, to see what it chooses from
    runner.model_peers = model_peers  # linked after start, as a worker links them

    def send(dest: ShardAddress, header: KvPages, k: torch.Tensor, v: torch.Tensor) -> None:
        shards[addresses.index(dest)].receive_kv(header, k, v)

    tokens = {f"r{i}": list(p) for i, p in enumerate(prompts)}
    seqs = [Sequence(r, len(t)) for r, t in tokens.items()]
    for s in seqs:
        runner.blocks.allocate(s.req_id, s.num_tokens)
    routes = [KvRoute(s.req_id, addresses, layer_wise=False) for s in seqs]
    shipper = KvShipper(routes, mc.num_hidden_layers, send)
    logits = runner.run(runner.plan_prefill(Batch(Phase.PREFILL, seqs), tokens, shipper))
    shipper.finish()
    steps = []
    for step in range(NUM_STEPS):
        for s, t in zip(seqs, logits.argmax(-1).tolist(), strict=True):
            tokens[s.req_id].append(t)
            s.num_computed, s.num_tokens = s.num_tokens, s.num_tokens + 1
        if between_steps is not None:
            between_steps(step)
        plan = runner.plan_decode([], seqs, tokens, step)
        logits = runner.run_decode(plan).logits
        steps.append(logits)
    return [tokens[s.req_id] for s in seqs], steps, links


@pytest.mark.parametrize(
    "overlap, lanes", [(False, 1), (True, 1), (False, 2), (True, 2), (False, 3), (True, 3)],
    ids=["plain", "overlap", "2lanes", "overlap-2lanes", "3lanes", "overlap-3lanes"],
)  # fmt: skip
def test_every_round_trip_variant_matches_the_single_process_runner(
    model, prompts, local, overlap, lanes
):
    expected, expected_logits = local
    got, logits, links = greedy_sharded(model, prompts, overlap, lanes)
    assert got == expected
    for ours, theirs in zip(logits, expected_logits, strict=True):
        assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4)
    for link in links:
        assert not link.replies  # every reply was read
        parts = [p for _, _, p in link.parts if p]
        # Overlap: each layer's q, then its k/v; never a whole (q, k, v) message.
        assert parts == [ATTEND_PREV, ATTEND_NEW] * (len(link.parts) // 2) if overlap else not parts
    if lanes > 1:  # interleaved per layer: every lane's layer i, then every lane's layer i + 1
        order = [(layer, lane) for lane, layer, part in links[0].parts if part != ATTEND_NEW]
        num_layers = model.config.num_hidden_layers
        one_step = [(layer, lane) for layer in range(num_layers) for lane in range(lanes)]
        assert order == one_step * NUM_STEPS


def test_auto_lanes_switch_after_the_measured_steps_and_keep_the_tokens(model, prompts, local):
    measured: list[MeasuredSteps] = []
    auto = AutoLanes(model.config.num_hidden_layers, warmup_steps=2,
                     choose=lambda m, num_peers: measured.append(m) or 3)  # fmt: skip
    got, _, links = greedy_sharded(model, prompts, overlap=False, lanes=1, auto_lanes=auto)
    assert got == local[0]
    [m] = measured  # chosen once, from the first 2 steps
    assert (m.num_steps, m.num_layers) == (2, model.config.num_hidden_layers) and m.step_s > 0
    num_layers = model.config.num_hidden_layers
    lanes = [lane for lane, _, _ in links[0].parts]
    assert lanes[: 2 * num_layers] == [0] * 2 * num_layers  # one lane while measuring
    assert lanes[2 * num_layers :] == [0, 1, 2] * num_layers * (NUM_STEPS - 2)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("lanes", [2, 3])
def test_a_shard_error_in_one_lane_raises_and_leaves_no_reply_queued(
    model, prompts, overlap, lanes
):
    links: list[InProcessLink] = []
    with pytest.raises(RuntimeError, match="attention shard failed: shard 0: boom"):
        greedy_sharded(model, prompts, overlap, lanes, fail_lane=lanes - 1, links=links)
    # The earlier lanes had their next layer in flight when the last one failed: their replies
    # were read too.
    assert len(links[0].parts) > 0 and not any(link.replies for link in links)


def test_a_reply_for_the_other_lane_is_a_link_fault_never_data(model, prompts):
    with pytest.raises(ShardLinkFault, match="lane 1, expected step 0 layer 0 lane 0"):
        greedy_sharded(model, prompts, overlap=False, lanes=2, lane_swap=True)


def test_new_kv_without_its_query_is_refused(model):
    mc = model.config
    spec = ShardSpec(num_layers=mc.num_hidden_layers, head_start=0, head_end=1,
                     num_queries_per_kv=mc.num_queries_per_kv, head_dim=mc.head_dim, num_blocks=4,
                     block_size=16, dtype=torch.float32, scale=1.0)  # fmt: skip
    shard = AttentionShard("s0", spec, select_backend("auto"))
    kv = torch.zeros(1, 1, mc.head_dim)
    with pytest.raises(ValueError, match="without its query"):
        shard.attend_new(AttendBatch(0, 0, part=ATTEND_NEW), kv, kv)


def test_lanes_split_the_sharded_rows_evenly_and_lane_0_takes_the_local_rows():
    lanes = split_lanes(num_local=2, num_sharded=5, num_lanes=2)
    assert [(lane.start, lane.end, lane.num_local) for lane in lanes] == [(0, 5, 2), (5, 7, 0)]
    assert [(lane.sharded_start, lane.sharded_end) for lane in lanes] == [(0, 3), (3, 5)]
    assert len(split_lanes(num_local=0, num_sharded=1, num_lanes=2)) == 1  # no empty lane
    three = split_lanes(num_local=1, num_sharded=5, num_lanes=3)
    assert [(lane.start, lane.end, lane.num_local) for lane in three] == [
        (0, 3, 1), (3, 5, 0), (5, 6, 0)
    ]  # fmt: skip
    assert [(lane.sharded_start, lane.sharded_end) for lane in three] == [(0, 2), (2, 4), (4, 5)]


class RecordingLink:
    def __init__(self) -> None:
        self.sent: list[tuple[AttendResult, list[torch.Tensor]]] = []

    def send(self, header: AttendResult, tensors: list[torch.Tensor]) -> None:
        self.sent.append((header, tensors))


def test_a_failed_first_half_is_answered_once_as_its_layers_error(model):
    """The shard worker: an ATTEND_PREV that fails is kept; its ATTEND_NEW gets the error,
    with buffers of the shapes the engine receives into (query heads, not KV heads)."""
    from services.shard.kv_news import KvNews
    from services.shard.step_gate import StepGate
    from services.shard.telemetry import ShardTelemetry
    from services.shard.worker import ShardWorker

    mc = model.config
    spec = ShardSpec(num_layers=mc.num_hidden_layers, head_start=0, head_end=1,
                     num_queries_per_kv=mc.num_queries_per_kv, head_dim=mc.head_dim, num_blocks=4,
                     block_size=16, dtype=torch.float32, scale=1.0)  # fmt: skip
    worker = ShardWorker.__new__(ShardWorker)  # its attention loop only: no sockets
    worker.shard = AttentionShard("s0", spec, select_backend("auto"))
    worker.telemetry = ShardTelemetry("s0", mc.num_hidden_layers)
    worker._prev_errors, worker._prev_s = {}, {}
    worker.gate, worker.news = StepGate(), KvNews()
    link = RecordingLink()
    q = torch.zeros(3, mc.num_queries_per_kv, mc.head_dim)
    kv = torch.zeros(3, 1, mc.head_dim)
    worker._attend_prev(AttendBatch(4, 0, part=ATTEND_PREV, lane=1), q)  # layer 0 without ids
    worker._answer(link, AttendBatch(4, 0, part=ATTEND_NEW, lane=1), [kv, kv])  # type: ignore[arg-type]
    ((reply, tensors),) = link.sent
    assert (reply.step, reply.layer, reply.lane) == (4, 0, 1) and "without req_ids" in reply.error
    assert [t.shape for t in tensors] == [q.shape]  # the output only, as an answer that worked
