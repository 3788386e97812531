"""No request's prompt stalls the others, and hostile chat bodies are 400s.

A router with an in-process engine on a real socket (uvicorn in a thread): four greedy streams
keep flowing (max gap between chunks under a generous bound) while an 8 MiB prompt and 8 MiB
chat bodies are refused, each before any tokenizing. The length bound is checked against the
tokenizer itself: a prompt it refuses really is past the context. Deep `chat_template_kwargs`
and the body shapes a deep schemathesis run found are 400s naming the field, never 500s.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from common.engine.core import LLMEngine
from common.gc_heap import freeze_startup_heap
from common.tokenizer import Tokenizer, _covers_bounded_text
from services.router.engine_client import InProcessEngineClient
from services.router.prompt_work import MAX_KWARGS_DEPTH, PromptBound
from services.router.server import MAX_BODY_BYTES, Router

MODEL = "tiny"
MAX_GAP_S = 0.25  # between two chunks of a stream, while the big bodies are refused
NUM_STREAMS = 4
STREAM_TOKENS = 3500  # each stream's max_tokens: it outlasts every round of refusals


@pytest.fixture(scope="module")
def router(tiny_model_path: Path) -> Iterator[Router]:
    # The cache holds every stream whole: a stream preempted for room stalls for its recompute,
    # which is not what the stall tests look for.
    engine = LLMEngine.from_path(
        tiny_model_path, num_blocks=NUM_STREAMS * (STREAM_TOKENS // 16 + 2)
    )
    router = Router(InProcessEngineClient(engine), tiny_model_path, MODEL)
    freeze_startup_heap()  # as Serve does for its replicas: full collections stay short
    yield router
    router.shutdown()
    router.client.shutdown()  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def live_server(router: Router) -> Iterator[str]:
    server = uvicorn.Server(
        uvicorn.Config(router.app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)  # uvicorn has no start event to wait on
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def big_bodies() -> list[tuple[str, bytes]]:
    """Bodies just under the router's body limit: prompts, a chat of empty messages, and a chat
    of one long user message."""
    room = MAX_BODY_BYTES - 200
    empty = {"role": "user", "content": ""}
    prompt = {"prompt": "ab " * (room // 3), "max_tokens": 2}
    chat = {"messages": [{"role": "user", "content": "x" * room}], "max_tokens": 2}
    one = len(json.dumps(empty, separators=(",", ":"))) + 1  # with its comma
    empties = {"messages": [empty] * (room // one), "max_tokens": 2}
    return [
        ("/v1/completions", _compact(prompt)),
        ("/v1/chat/completions", _compact(empties)),
        ("/v1/chat/completions", _compact(chat)),
        ("/tokenize", _compact(chat)),
    ]


def _compact(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


@dataclass
class Round:
    """One round of refusals while four streams ran: the refusals' statuses and the streams'
    largest gap between two chunks before any big body was sent (the machine's own jitter) and
    while they were being refused."""

    statuses: list[int]
    before_s: float
    during_s: float

    def stalled(self) -> bool:
        # NOTE: on a machine busy with other work (CI runs two test workers and mypy on two
        # cores) the streams' gaps grow before any big body is sent; the bound is on what the
        # bodies add to that, with the machine's jitter counted twice: it comes in bursts. A
        # freeze by the bodies (each tokenized, or parsed back to back) stops the streams for
        # seconds.
        return self.during_s >= MAX_GAP_S + 2 * self.before_s


@dataclass
class Gaps:
    """What four streams saw while the big bodies were refused, round after round: each
    stream's chunk arrival times and each round's figures. The rounds end at the first one
    without a stall: other work on a shared machine only ever lengthens a gap, so a round
    without a stall shows what the bodies themselves cost, while a freeze by the bodies stalls
    every round."""

    arrivals: list[list[float]]
    rounds: list[Round]
    refused_at: float  # the last round's last refusal

    def check(self, num_bodies: int) -> None:
        assert all(r.statuses == [400] * num_bodies for r in self.rounds), self.rounds
        assert not self.rounds[-1].stalled(), self.rounds
        # The refusals came while every stream still ran: each has a chunk after the last one.
        assert all(a[-1] > self.refused_at and len(a) < STREAM_TOKENS for a in self.arrivals)


def stream_gaps_while_refused(
    base_url: str,
    bodies: list[tuple[str, bytes]],
    headers: dict[str, str] | None = None,
    max_rounds: int = 3,
) -> Gaps:
    """Start NUM_STREAMS greedy streams; once all of them flow, send every big body at once,
    up to `max_rounds` times until a round shows no stall, and keep reading the streams until
    half a second after the last refusal (then leave: the router aborts the rest)."""
    arrivals: list[list[float]] = [[] for _ in range(NUM_STREAMS)]
    leave_after: list[float] = []  # set once the rounds end: half a second after the last refusal

    async def stream(http: httpx.AsyncClient, i: int, started: asyncio.Event) -> None:
        body = {"model": MODEL, "prompt": f"stream {i}", "max_tokens": STREAM_TOKENS,
                "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    arrivals[i].append(time.monotonic())
                    started.set()
                if leave_after and arrivals[i][-1] > leave_after[0]:
                    break

    async def refuse(http: httpx.AsyncClient, path: str, body: bytes) -> int:
        response = await http.post(path, content=body,
                                   headers={"Content-Type": "application/json"})  # fmt: skip
        return response.status_code

    def chunk_gaps() -> list[tuple[float, float]]:
        """Every stream's gaps between two chunks, its wait for the next one so far among them
        (a stream frozen past a round's end is a gap, not a missing one)."""
        now = time.monotonic()
        return [(a, b) for times in arrivals for a, b in zip(times, [*times[1:], now], strict=True)]

    async def scenario() -> Gaps:
        async with httpx.AsyncClient(base_url=base_url, timeout=120, headers=headers) as http:
            started = [asyncio.Event() for _ in range(NUM_STREAMS)]
            streams = [asyncio.create_task(stream(http, i, e)) for i, e in enumerate(started)]
            await asyncio.gather(*(e.wait() for e in started))
            rounds: list[Round] = []
            while not rounds or (rounds[-1].stalled() and len(rounds) < max_rounds):
                quiet_from = time.monotonic()
                await asyncio.sleep(1.0)  # the streams' own gaps first: the machine's jitter
                sent_at = time.monotonic()
                statuses = await asyncio.gather(*(refuse(http, p, b) for p, b in bodies))
                refused_at = time.monotonic()
                await asyncio.sleep(0.5)  # the chunks after the refusals
                gaps = chunk_gaps()
                # The gaps wholly in the quiet second (none: a stall as long as it), and every
                # gap that overlaps the refusals.
                before = max((b - a for a, b in gaps if a > quiet_from and b < sent_at),
                             default=sent_at - quiet_from)  # fmt: skip
                during = max(b - a for a, b in gaps if b > sent_at and a < refused_at)
                rounds.append(Round(list(statuses), before, during))
            leave_after.append(refused_at + 0.5)
            await asyncio.gather(*streams)
            return Gaps(arrivals, rounds, refused_at)

    return asyncio.run(scenario())


def test_streams_keep_flowing_while_8_mib_prompts_are_refused(
    router: Router, live_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenized: list[int] = []  # the length of every text the router tokenized
    tokenizer = router.tokenizer
    for name in ("encode", "encode_long", "apply_chat_template"):
        method = getattr(tokenizer, name)

        def spy(text: Any, *args: Any, _method: Any = method) -> Any:
            tokenized.append(len(text))
            return _method(text, *args)

        monkeypatch.setattr(tokenizer, name, spy)
    bodies = big_bodies()
    assert all(MAX_BODY_BYTES - 300 < len(body) <= MAX_BODY_BYTES for _, body in bodies)
    stream_gaps_while_refused(live_server, bodies).check(len(bodies))
    assert max(tokenized) < 1000, "a big prompt reached the tokenizer"


def test_the_stall_check_sees_a_router_frozen_by_each_refused_body(
    live_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check above is not vacuous: a router that blocks its event loop on each big body
    (as tokenizing one there did) stalls the streams past the bound in a round."""
    check_text = PromptBound.check_text

    def frozen(self: PromptBound, text: str, param: str) -> None:
        time.sleep(1.0)  # NOTE: a blocking wait, on purpose: the loop stops as a freeze stops it
        check_text(self, text, param)

    monkeypatch.setattr(PromptBound, "check_text", frozen)
    gaps = stream_gaps_while_refused(live_server, big_bodies(), max_rounds=1)
    assert gaps.rounds[0].stalled(), gaps.rounds


def test_a_prompt_the_bound_refuses_is_past_the_context(tiny_model_path: Path) -> None:
    """The worst case for the bound: the token standing for the most bytes, repeated."""
    tokenizer = Tokenizer(tiny_model_path)
    assert tokenizer.max_token_bytes is not None
    texts = [tokenizer.decode([i]) for i in range(tokenizer.vocab_size)]
    longest = max(texts, key=lambda t: len(t.encode()))
    bound = PromptBound(tokenizer, max_model_len=64)
    for text in (longest * 64, "a" * 5000, "日本" * 800, " " * 5000):
        refused = _refuses(bound, text)
        if refused:
            assert len(tokenizer.encode(text)) >= 64, text[:20]
    assert _refuses(bound, "a" * 64 * tokenizer.max_token_bytes)
    assert not _refuses(bound, "a" * 63 * tokenizer.max_token_bytes)


def _refuses(bound: PromptBound, text: str) -> bool:
    from services.router.api_errors import APIError

    try:
        bound.check_text(text, "prompt")
    except APIError as exc:
        assert exc.status == 400 and exc.param == "prompt"
        return True
    return False


@pytest.mark.parametrize(
    ("spec", "bounded"),
    [
        ({"model": {"type": "BPE"}, "pre_tokenizer": {"type": "ByteLevel"}}, True),
        # Llama 2's: SentencePiece spaces, byte fallback for unknown text.
        ({"model": {"type": "BPE", "unk_token": "<unk>", "byte_fallback": True},
          "normalizer": {"type": "Sequence", "normalizers": [
              {"type": "Prepend", "prepend": "▁"},
              {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}}, True),
        ({"model": {"type": "BPE", "unk_token": "<unk>"}}, False),  # one token per unknown run
        ({"model": {"type": "WordPiece", "unk_token": "[UNK]"}}, False),
        ({"model": {"type": "BPE"}, "pre_tokenizer": {"type": "Whitespace"}}, False),  # drops
        ({"model": {"type": "BPE"}, "normalizer": {"type": "Strip"}}, False),
        ({"model": {"type": "BPE"}, "normalizer": {"type": "NFKC"}}, False),  # may shrink
        ({"model": {"type": "BPE"}, "normalizer": {
            "type": "Replace", "pattern": {"String": "  "}, "content": " "}}, False),
    ],
)  # fmt: skip
def test_only_a_tokenizer_whose_tokens_stand_for_bounded_text_gets_a_bound(
    spec: dict[str, Any], bounded: bool
) -> None:
    assert _covers_bounded_text(spec) is bounded


def post(router: Router, path: str, body: bytes) -> httpx.Response:
    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=router.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as http:
            headers = {"Content-Type": "application/json"}
            return await http.post(path, content=body, headers=headers, timeout=60)

    return asyncio.run(main())


def test_a_chat_with_more_turns_than_the_context_is_refused_before_rendering(
    router: Router, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unexpected(*_: Any) -> Any:
        raise AssertionError("rendered")

    monkeypatch.setattr(router.tokenizer, "apply_chat_template", unexpected)
    turns = [{"role": r, "content": ""} for r in ("user", "assistant")] * router.max_model_len
    for path in ("/v1/chat/completions", "/tokenize"):
        response = post(router, path, json.dumps({"messages": turns}).encode())
        assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


def test_a_big_chat_of_more_messages_than_a_chat_holds_is_refused_unparsed(
    router: Router, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counting its role keys is a scan; parsing it would hold the event loop the longest."""
    _, body = big_bodies()[1]  # the chat of empty messages
    parsed: list[int] = []
    loads = json.loads

    def spy(text: Any, *args: Any, **kwargs: Any) -> Any:
        parsed.append(len(text))
        return loads(text, *args, **kwargs)

    monkeypatch.setattr(json, "loads", spy)  # what FastAPI parses request bodies with
    response = post(router, "/v1/chat/completions", body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    assert max(parsed, default=0) < 1000, "the body was parsed"


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


# What a deep schemathesis run sent (lone surrogates in unknown keys, developer and tool messages
# with null content or parts carrying extra fields, many choices), and deep template kwargs.
HOSTILE_CHAT_BODIES = [
    '{"\\ud800": "\\udfff", "messages": [{"role": "developer", "content": null, '
    '"\\udc00x": 1}, {"role": "tool", "content": [{"type": "text", "text": "a", '
    '"\\ud800": {"extra": [1]}}]}], "n": 41, "max_tokens": 1}',
    '{"messages": [{"role": "tool", "content": null}], "n": 41, "max_tokens": 1}',
    '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
    '{"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": {"\\ud800": "x"}}',
    '{"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "nested": '
    '[{"type": "text", "text": null}]}]}], "n": 41, "max_tokens": 1}',
    '{"messages": [{"role": "user", "content": "a"}], "max_tokens": 1, '
    '"chat_template_kwargs": {"x": ' + _nested(450).decode() + "}}",
]


@pytest.mark.parametrize("depth", [MAX_KWARGS_DEPTH + 1, 450, 5000])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_deep_chat_template_kwargs_are_a_400(router: Router, path: str, depth: int) -> None:
    body = (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
            b'"chat_template_kwargs": {"x": ' + _nested(depth) + b"}}")  # fmt: skip
    response = post(router, path, body)
    assert response.status_code == 400, response.text
    if depth < 1000:  # deeper still, the JSON parser refuses the body first
        assert response.json()["error"]["param"] == "chat_template_kwargs"


def test_kwargs_within_the_depth_bound_reach_the_template(router: Router) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"x": json.loads(_nested(MAX_KWARGS_DEPTH - 1))}}  # fmt: skip
    assert post(router, "/tokenize", json.dumps(body).encode()).status_code == 200


@pytest.mark.parametrize("body", HOSTILE_CHAT_BODIES)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_hostile_chat_bodies_are_answered_without_a_server_error(
    router: Router, path: str, body: str
) -> None:
    response = post(router, path, body.encode())
    assert response.status_code in (200, 400, 429), response.text
    if response.status_code == 400:
        param = response.json()["error"]["param"]
        assert param.split(".")[0] in ("messages", "chat_template_kwargs"), param
    if '"content": null' in body:  # only an assistant's turn with tool calls goes without
        assert response.status_code == 400, response.text
        assert "needs content" in response.json()["error"]["message"]
