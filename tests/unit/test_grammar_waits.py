"""Grammars compiled off the engine's loop: `GrammarWaits` holds a request's message while its
spec compiles on the compile pool, wakes the loop's poller when it is done, and the engine then
builds the request's matcher without compiling anything itself."""

from __future__ import annotations

import json
import select
import threading
from pathlib import Path

import pytest

import common.structured.grammar as grammar_module
from common.engine.grammars import EngineGrammars, GrammarWaits
from common.sampling_params import SamplingParams
from common.structured.spec import parse_structured_output as parse

DEADLINE_S = 60.0  # a hang, not a speed: a compile of these specs is milliseconds


@pytest.fixture
def grammars(tiny_model_path: Path) -> EngineGrammars:
    config = json.loads((tiny_model_path / "config.json").read_text())
    return EngineGrammars(tiny_model_path, config["vocab_size"], config["eos_token_id"])


@pytest.fixture
def compile_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The name of the thread of every grammar compile from here on."""
    names: list[str] = []
    build = grammar_module.grammar_for_spec

    def recording(spec: str) -> str:
        names.append(threading.current_thread().name)
        return build(spec)

    monkeypatch.setattr(grammar_module, "grammar_for_spec", recording)
    return names


def woken(waits: GrammarWaits) -> bool:
    """Whether the loop's poller would wake for `waits` within the deadline."""
    readable, _, _ = select.select([waits.fileno()], [], [], DEADLINE_S)
    return bool(readable)


def test_a_new_spec_compiles_off_the_loop(
    grammars: EngineGrammars, compile_threads: list[str]
) -> None:
    spec = parse(guided_json={"type": "object", "properties": {"a": {"type": "integer"}}})
    waits: GrammarWaits[str] = GrammarWaits(grammars)
    assert not waits.hold("free", None, "free text goes on")
    assert waits.hold("r1", spec, "message 1")
    assert woken(waits)
    assert waits.ready() == ["message 1"] and waits.num_held() == 0
    assert compile_threads and threading.current_thread().name not in compile_threads
    compiled = len(compile_threads)
    matcher = grammars.matcher(SamplingParams(structured_output=spec), [])
    assert matcher is not None and len(compile_threads) == compiled  # nothing compiled here
    assert not waits.hold("r2", spec, "message 2")  # compiled already: goes on at once
    waits.close()


def test_an_aborted_request_is_not_handed_on(grammars: EngineGrammars) -> None:
    spec = parse(guided_regex="[a-z]{3}")
    waits: GrammarWaits[str] = GrammarWaits(grammars)
    assert waits.hold("r1", spec, "message 1")
    assert waits.drop("r1") and not waits.drop("r1")
    assert woken(waits)
    assert waits.ready() == []
    waits.close()


def test_a_spec_that_does_not_compile_is_handed_on_and_refused_without_recompiling(
    grammars: EngineGrammars, compile_threads: list[str]
) -> None:
    spec = '{"type":"no-such-kind"}'  # past the router's checks only by a bug: still one request
    waits: GrammarWaits[str] = GrammarWaits(grammars)
    assert waits.hold("r1", spec, "message 1")
    assert woken(waits)
    assert waits.ready() == ["message 1"]
    assert grammars.is_ready(spec)
    for _ in range(2):
        with pytest.raises(ValueError, match="structured_output"):
            grammars.matcher(SamplingParams(structured_output=spec))
    assert len(compile_threads) == 1
    waits.close()
