"""Long prefills a chunk a step (services/engine/prefill_chunks.py): the spans a batch is cut into,
a request aborted between chunks, and, on engines wired in-process, a decode step between every
two chunks while the engine decodes, with every request's greedy tokens equal to the
single-process engine's."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from common.block_manager import BlockManager
from common.config import SchedulerConfig
from common.mesh_options import MeshOptions
from common.protocol import GenerateRequest, ShardAddress
from common.roles import Role
from common.sampling_params import SamplingParams
from common.scheduling.batching import EngineScheduler, Sequence
from services.engine.engine import Engine
from services.engine.outbox import Outbox
from services.engine.prefill_chunks import PrefillChunks
from tests.conftest import random_prompts
from tests.unit.test_engine_kv_ingress import single_process_tokens


def queue_of(*lengths: int) -> EngineScheduler:
    scheduler = EngineScheduler(BlockManager(64, 16), SchedulerConfig())
    for i, n in enumerate(lengths):
        scheduler.add(Sequence(f"r{i}", n))
    return scheduler


def spans(step) -> list[tuple[str, int, int]]:  # type: ignore[no-untyped-def]
    return [(s.req_id, s.num_computed, s.num_tokens) for s in step.batch.seqs]


def test_a_long_batch_is_cut_into_chunks_then_run_whole_from_where_they_left_it() -> None:
    scheduler, chunks = queue_of(40, 30), PrefillChunks(chunk_tokens=16)
    steps = []
    while (step := chunks.next_step(scheduler)) is not None and step.is_chunk:
        steps.append(spans(step))
    # Each chunk is one sequence's next span, never its last token (the last step samples it),
    # until what is left fits one chunk.
    assert steps == [[("r0", 0, 16)], [("r0", 16, 32)], [("r0", 32, 39)], [("r1", 0, 16)]]
    assert step is not None and spans(step) == [("r0", 39, 40), ("r1", 16, 30)]
    assert chunks.num_chunks == 4 and chunks.batch is None


def test_a_batch_of_one_chunk_or_less_runs_as_it_is() -> None:
    scheduler, chunks = queue_of(10, 6), PrefillChunks(chunk_tokens=16)
    step = chunks.next_step(scheduler)
    assert step is not None and not step.is_chunk
    assert spans(step) == [("r0", 0, 10), ("r1", 0, 6)]
    assert chunks.num_chunks == 0 and chunks.decode_owed  # 16 prefill tokens since a decode
    chunks.decoded()
    assert not chunks.decode_owed


def test_a_request_aborted_between_chunks_leaves_the_batch() -> None:
    scheduler, chunks = queue_of(40, 30), PrefillChunks(chunk_tokens=16)
    step = chunks.next_step(scheduler)
    assert step is not None and spans(step) == [("r0", 0, 16)]
    scheduler.remove("r0")  # the engine's abort: the scheduler frees its blocks
    step = chunks.next_step(scheduler)
    assert step is not None and spans(step) == [("r1", 0, 16)]
    scheduler.remove("r1")
    assert chunks.next_step(scheduler) is None and chunks.batch is None


class ShippingMixedEngine:
    """A mixed engine that decodes its own prompts and ships others' KV to a token engine (no
    sockets: their messages carried here), whose chunk steps and decode tokens are recorded."""

    def __init__(self, model_path: Path, chunk_tokens: int) -> None:
        self.kv: list[tuple] = []
        self.outputs: dict[str, list[int]] = {}
        options = MeshOptions(num_blocks=64, prefill_chunk_tokens=chunk_tokens)
        self.mixed = Engine.build("m", Role.MIXED, options, str(model_path), self._ship,
                                  command_endpoint="m-cmd")  # fmt: skip
        self.token = Engine.build("t", Role.TOKEN, MeshOptions(num_blocks=64), str(model_path),
                                  self._ship, command_endpoint="t-cmd")  # fmt: skip

    def _ship(self, dest: ShardAddress, pages, k: torch.Tensor, v: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
        self.kv.append((pages, k.clone(), v.clone()))

    def deliver(self, outbox: Outbox) -> None:
        for _, output in outbox.outputs:
            self.outputs.setdefault(output.req_id, []).extend(output.token_ids)
        for _, handoff in outbox.handoffs:
            self.deliver(self.token.on_handoff(handoff))
        while self.kv:
            self.deliver(self.token.on_kv(*self.kv.pop(0)))

    def submit(self, req_id: str, prompt: list[int], params: SamplingParams, where: str) -> None:
        msg = GenerateRequest(req_id, prompt, params.to_spec(), "router", where, "t-kv")
        self.deliver(self.mixed.on_generate(msg))


def test_a_mixed_engine_decodes_between_the_chunks_of_a_prompt_it_ships(
    tiny_model_path: Path,
) -> None:
    local, shipped = random_prompts([12, 100], vocab=2048, seed=21)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    pair = ShippingMixedEngine(tiny_model_path, chunk_tokens=16)
    pair.submit("local", local, greedy, where="m-cmd")
    pair.deliver(pair.mixed.step())  # its prefill: "local" decodes here from now on
    pair.submit("shipped", shipped, greedy, where="t-cmd")
    kinds = []  # per step of the mixed engine: a chunk, or a decode of "local"
    while "shipped" not in pair.outputs:
        chunks_before, tokens_before = pair.mixed.chunks.num_chunks, len(pair.outputs["local"])
        pair.deliver(pair.mixed.step())
        if pair.mixed.chunks.num_chunks > chunks_before:
            kinds.append("chunk")
        elif len(pair.outputs["local"]) > tokens_before:
            kinds.append("decode")
    assert kinds.count("chunk") == 6  # 99 tokens before its last: 16-token spans
    assert "chunk chunk" not in " ".join(kinds)  # a decode step between every two chunks
    for _ in range(100):
        if not (pair.mixed.has_work() or pair.token.has_work()):
            break
        pair.deliver(pair.mixed.step())
        if pair.token.has_work():
            pair.deliver(pair.token.step())
    for req_id, prompt in (("local", local), ("shipped", shipped)):
        assert pair.outputs[req_id] == single_process_tokens(tiny_model_path, prompt, greedy)


@pytest.mark.parametrize("bad", [0, -512, "512"])
def test_a_chunk_size_that_is_not_a_positive_count_is_refused_naming_it(bad: object) -> None:
    with pytest.raises(msgspec.ValidationError, match="prefill_chunk_tokens"):
        msgspec.convert({"prefill_chunk_tokens": bad}, MeshOptions)
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        PrefillChunks(chunk_tokens=0)  # built in process, without the options' check
