"""A prompt engine and a token engine wired in-process (their `on_*` inputs and `step` outputs,
no sockets): KV shipped to a token engine's own cache lands through its `KvIngress`. A request
whose KV does not fit there ends alone with a retryable error (the router re-runs it); its
batch-mate decodes exactly what the single-process engine does, and the token engine's blocks are
all free afterwards. Before, the allocation raised in the worker's drain and killed the engine."""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

import msgspec
import structlog
import torch

from common.config import EngineConfig
from common.engine.core import LLMEngine
from common.mesh_options import MeshOptions
from common.protocol import GenerateRequest, LoadReport, ShardAddress, TokenOutput
from common.roles import Role
from common.sampling_params import SamplingParams
from services.engine.engine import Engine
from services.engine.faults import HANDOFF_KV_WAIT_S, EngineFaults
from services.engine.outbox import Outbox
from tests.conftest import random_prompts


def single_process_tokens(model_path: Path, prompt: list[int], params: SamplingParams) -> list[int]:
    """What `LLMEngine`, the single-process reference, generates for `prompt`."""
    engine = LLMEngine(EngineConfig(str(model_path)), with_tokenizer=False)
    return engine.generate([prompt], params)[0]


class InProcessPair:
    """Carries every message between the two engines and collects the router's outputs."""

    def __init__(self, model_path: Path) -> None:
        self.outputs: dict[str, list[TokenOutput]] = defaultdict(list)
        self.kv: list[tuple] = []
        prompt = MeshOptions(num_blocks=1024, layer_wise_min_tokens=32)
        self.prompt = Engine.build("p", Role.PROMPT, prompt, str(model_path), self._ship,
                                   command_endpoint="p-cmd")  # fmt: skip
        small = MeshOptions(num_blocks=8, block_size=16)
        self.token = Engine.build("t", Role.TOKEN, small, str(model_path), self._ship,
                                  command_endpoint="t-cmd")  # fmt: skip

    def _ship(self, dest: ShardAddress, pages, k: torch.Tensor, v: torch.Tensor) -> None:
        assert dest.kv_endpoint == "t-kv"
        self.kv.append((pages, k.clone(), v.clone()))

    def deliver(self, outbox: Outbox) -> None:
        for _, output in outbox.outputs:
            self.outputs[output.req_id].append(output)
        for endpoint, handoff in outbox.handoffs:
            assert endpoint == "t-cmd"
            self.deliver(self.token.on_handoff(handoff))
        assert all(endpoint == "t-kv" for endpoint, _ in outbox.frees)

    def submit(
        self, req_id: str, prompt: list[int], params: SamplingParams, reply_to: str = "router"
    ) -> None:
        """A router's GenerateRequest to the prompt engine, decoding on the token engine."""
        message = GenerateRequest(req_id, prompt, params.to_spec(), reply_to, "t-cmd", "t-kv")
        self.deliver(self.prompt.on_generate(message))

    def run(self) -> None:
        for _ in range(500):
            if not (self.prompt.has_work() or self.token.has_work() or self.kv):
                return
            if self.prompt.has_work():
                self.deliver(self.prompt.step())
            while self.kv:  # KV may land before or after its hand-off: both orders happen live
                self.deliver(self.token.on_kv(*self.kv.pop(0)))
            if self.token.has_work():
                self.deliver(self.token.step())
        raise AssertionError("the engines did not finish")


def test_kv_that_does_not_fit_fails_its_request_alone(tiny_model_path: Path) -> None:
    small, large = random_prompts([40, 200], vocab=2048, seed=3)  # 8 blocks hold 128 tokens
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = single_process_tokens(tiny_model_path, small, greedy)

    pair = InProcessPair(tiny_model_path)
    for req_id, prompt in (("large", large), ("small", small)):
        pair.submit(req_id, prompt, greedy)
    pair.run()

    large_out = pair.outputs["large"]
    assert large_out[-1].error and large_out[-1].retryable and "no room" in large_out[-1].error
    assert [t for o in pair.outputs["small"] for t in o.token_ids] == expected
    assert pair.outputs["small"][-1].finish_reason == "length"
    assert pair.token.blocks.num_used_blocks == 0 and not pair.token.table.requests


def test_a_hand_off_whose_kv_never_lands_does_not_hold_the_queue(tiny_model_path: Path) -> None:
    lost, second = random_prompts([30, 20], vocab=2048, seed=4)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = single_process_tokens(tiny_model_path, second, greedy)
    pair = InProcessPair(tiny_model_path)
    pair.submit("lost", lost, greedy)
    pair.deliver(pair.prompt.step())
    pair.kv.clear()  # its prompt engine died mid-transfer: the KV never lands
    pair.submit("second", second, greedy)
    pair.run()  # "second" waits behind "lost" (FCFS) ...
    assert pair.outputs["second"][-1].finish_reason == ""
    pair.deliver(EngineFaults(pair.token).expire(time.monotonic() + HANDOFF_KV_WAIT_S + 1))
    assert pair.outputs["lost"][-1].retryable and "did not arrive" in pair.outputs["lost"][-1].error
    pair.run()  # ... until "lost" is given up
    assert [t for o in pair.outputs["second"] for t in o.token_ids] == expected
    assert pair.token.blocks.num_used_blocks == 0


def test_a_lost_router_ends_only_its_own_requests(tiny_model_path: Path) -> None:
    mine, theirs = random_prompts([30, 20], vocab=2048, seed=5)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = single_process_tokens(tiny_model_path, theirs, greedy)
    pair = InProcessPair(tiny_model_path)
    for req_id, prompt, router in (("mine", mine, "router-a"), ("theirs", theirs, "router-b")):
        pair.submit(req_id, prompt, greedy, reply_to=router)
    pair.deliver(pair.prompt.step())
    while pair.kv:
        pair.deliver(pair.token.on_kv(*pair.kv.pop(0)))
    pair.deliver(
        EngineFaults(pair.token).lost_reply_to("router-a")
    )  # router-a's connection stayed down
    pair.deliver(EngineFaults(pair.prompt).lost_reply_to("router-a"))
    report = pair.prompt.load_report(time.time())
    assert report.received_requests == {"router-b": 1}
    assert report.prompt_tokens_in == 30 + 20  # a counter: what it received, lost or not
    lost = pair.outputs["mine"][-1]
    assert lost.retryable and "lost its router" in lost.error
    pair.run()
    assert [t for o in pair.outputs["theirs"] for t in o.token_ids] == expected
    assert pair.token.blocks.num_used_blocks == 0 and not pair.token.table.requests


def test_a_requests_decode_load_is_reported_by_one_engine_or_the_other(
    tiny_model_path: Path,
) -> None:
    """From its arrival at the prompt engine to its end, a request's decode tokens are in the
    prompt engine's `handoff_tokens` (for its token engine) or in the token engine's own
    `running_decode_tokens` (from its hand-off on, its KV landed or not): a router that adds
    the first to the second never loses it between the two engines' reports
    (services/router/cluster_scheduler.py)."""
    (prompt,) = random_prompts([40], vocab=2048, seed=6)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    pair = InProcessPair(tiny_model_path)

    def reported() -> tuple[int, int]:
        now = time.time()
        held = pair.prompt.load_report(now).handoff_tokens
        assert set(held) <= {"t-cmd"}  # keyed by the token engine's command endpoint
        return held.get("t-cmd", 0), pair.token.load_report(now).running_decode_tokens

    def finished() -> bool:
        return bool(pair.outputs["r"]) and bool(pair.outputs["r"][-1].finish_reason)

    pair.submit("r", prompt, greedy)
    assert reported() == (len(prompt), 0)
    seen = []
    for _ in range(100):
        if finished():
            break
        if pair.prompt.has_work():
            pair.deliver(pair.prompt.step())
            # Handed off, its KV not landed yet: the token engine holds it, waiting.
            held, running = reported()
            seen.append((held, running))
            assert finished() or held + running >= len(prompt), seen
        while pair.kv:
            pair.deliver(pair.token.on_kv(*pair.kv.pop(0)))
        held, running = reported()
        seen.append((held, running))
        if not finished():
            assert held + running >= len(prompt), seen
        if pair.token.has_work():
            pair.deliver(pair.token.step())
    assert pair.outputs["r"][-1].finish_reason == "length"
    assert any(running and not held for held, running in seen)  # it did move to the token engine
    assert reported() == (0, 0)


def test_reports_count_each_routers_requests_received_rejected_ones_too(
    tiny_model_path: Path,
) -> None:
    """A router re-adds its placements past this count to the report (cluster_scheduler.py): a
    request the engine refused was still received, and must not count as on its way forever."""
    pair = InProcessPair(tiny_model_path)
    assert pair.prompt.load_report(time.time()).received_requests == {}
    prompts = random_prompts([20, 20, 20], vocab=2048, seed=8)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    pair.submit("a", prompts[0], params, reply_to="tcp://r1")
    pair.submit("b", prompts[1], params, reply_to="tcp://r2")
    pair.submit("c", [10**9], params, reply_to="tcp://r1")  # refused: a token id past the vocab
    assert pair.outputs["c"][0].finish_reason == "error"
    report = pair.prompt.load_report(time.time())
    assert report.received_requests == {"tcp://r1": 2, "tcp://r2": 1}
    assert report.pending_prompt_tokens == 40


def test_a_count_gone_below_zero_is_reported_as_zero_and_the_report_still_decodes(
    tiny_model_path: Path,
) -> None:
    """A router drops a report with a negative count; an engine whose own running count went
    wrong must still be heard (with 0), not go silent with its last load in every router."""
    pair = InProcessPair(tiny_model_path)
    pair.prompt.ship_queue.policy.pending_prompt_tokens = -5  # a bookkeeping bug, simulated
    with structlog.testing.capture_logs() as logs:
        wires = [msgspec.msgpack.encode(pair.prompt.load_report(time.time())) for _ in range(3)]
    assert all(msgspec.msgpack.decode(w, type=LoadReport).pending_prompt_tokens == 0 for w in wires)
    assert [e["log_level"] for e in logs if "below zero" in e["event"]] == ["error"]  # said once
