"""A request's grammar compiles off the engine's loop: a real `EngineWorker` (mixed, local KV)
holds a request whose spec is new while its compile pool builds it, then runs it; the loop's own
thread (this test's, which drives it pass by pass) never compiles. The output equals the
single-process engine's, greedy, and a request aborted while it waits never runs."""

from __future__ import annotations

import secrets
import select
import threading
from pathlib import Path

import pytest

import common.structured.grammar as grammar_module
from common.engine.core import LLMEngine
from common.mesh_options import MeshOptions
from common.protocol import AbortRequest, GenerateRequest, TokenOutput
from common.roles import Role
from common.sampling_params import SamplingParams
from common.structured.spec import parse_structured_output as parse
from common.tokenizer import Tokenizer
from common.worker_config import WorkerConfig
from services.engine.outbox import Outbox
from services.engine.worker import EngineWorker
from tests.unit.json_schemas import SCHEMAS, json_ending_bias

DEADLINE_S = 60.0  # a hang, not a speed


def test_a_new_grammar_compiles_off_the_loop_and_the_output_is_the_engines(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiled_on: list[str] = []
    build = grammar_module.grammar_for_spec

    def recording(spec: str) -> str:
        compiled_on.append(threading.current_thread().name)
        return build(spec)

    monkeypatch.setattr(grammar_module, "grammar_for_spec", recording)
    tokenizer = Tokenizer(tiny_model_path)
    reference = LLMEngine.from_path(tiny_model_path, num_blocks=64)
    bias = tuple(sorted(json_ending_bias(tokenizer, reference.model_config.eos_token_ids).items()))
    spec = parse(guided_json=SCHEMAS["nested_object"])
    params = SamplingParams(max_tokens=120, temperature=0.0, logit_bias=bias,
                            structured_output=spec)  # fmt: skip
    prompt = tokenizer.encode("Reply in JSON:")
    [expected] = reference.generate([prompt], params)
    compiled_on.clear()  # the reference compiled on this thread: it is no engine service

    cfg = WorkerConfig(service_id="mixed-0", role=Role.MIXED, model_path=str(tiny_model_path),
                       ready_endpoint="", options=MeshOptions(num_blocks=64),
                       mesh_key=secrets.token_hex(16))  # fmt: skip
    worker = EngineWorker(cfg)
    sent: list[TokenOutput] = []

    def capture(outbox: Outbox, retry: bool = True) -> None:
        sent.extend(out for _, out in outbox.outputs)

    monkeypatch.setattr(worker, "_send", capture)
    try:
        for req_id in ("r1", "aborted"):
            worker._on_command(GenerateRequest(
                req_id, prompt, params.to_spec(), reply_to="inproc://router",
                token_engine=worker.command_endpoint, token_kv_endpoint="",
            ))  # fmt: skip
        worker._on_command(AbortRequest("aborted"))
        assert worker.grammar_waits.num_held() == 1 and not worker.engine.has_work()
        # NOTE: each held request's compile wakes the loop when it ends, in either order: the
        # aborted one's may come first and hand nothing on.
        while worker.grammar_waits.num_held():
            readable, _, _ = select.select([worker.grammar_waits.fileno()], [], [], DEADLINE_S)
            assert readable, "the compile never finished"
            worker._drain()
        assert worker.engine.has_work()
        while worker.engine.has_work():
            worker._step()
    finally:
        worker.running = False
        worker.run()  # no pass: closes its sockets and links
    assert compiled_on and threading.current_thread().name not in compiled_on
    assert all(out.req_id == "r1" for out in sent)
    assert not any(out.error for out in sent), [out.error for out in sent]
    assert [t for out in sent for t in out.token_ids] == expected
    assert sent[-1].finish_reason == "stop"
