"""The sampling surface over HTTP, single-process topology: n, best_of, logprobs, echo, penalties
and logit_bias through the real FastAPI app, a real `InProcessEngineClient` and the official
`openai` client. Logprobs are checked against log_softmax of the model's own full-sequence logits
(`tests/reference_logprobs.py`), greedy text against a separate `LLMEngine`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from common.engine.core import LLMEngine
from common.sampling_params import SamplingParams
from services.router.choices import merge
from services.router.server import Router
from services.router.streams import AdmissionLimits
from tests.reference_logprobs import expected_token_logprobs, sequence_logprobs
from tests.unit.test_openai_api import MODEL, call, make_router, post, serving_router, sse_events

TOL = 1e-4


@pytest.fixture(scope="module")
def router(tiny_model_path: Path) -> Iterator[Router]:
    yield from serving_router(tiny_model_path)


@pytest.fixture(scope="module")
def reference(tiny_model_path: Path) -> LLMEngine:
    return LLMEngine.from_path(tiny_model_path, num_blocks=256)


def greedy_ids(reference: LLMEngine, prompt_ids: list[int], n: int) -> list[int]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return reference.generate([prompt_ids], params)[0]


def test_n_choices_differ_are_reproducible_and_sum_their_usage(router: Router) -> None:
    body = {"model": MODEL, "prompt": [30, 31, 32], "max_tokens": 8, "n": 3, "seed": 5}
    body |= {"temperature": 1.0, "ignore_eos": True}
    first, again = (post(router, "/v1/completions", body).json() for _ in range(2))
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    texts = [c["text"] for c in first["choices"]]
    assert len(set(texts)) > 1  # derived seeds: the choices differ
    assert texts == [c["text"] for c in again["choices"]]  # ... reproducibly
    single = post(router, "/v1/completions", body | {"n": 1}).json()
    assert single["choices"][0]["text"] == texts[0]  # choice 0 keeps the request's seed
    assert first["usage"] == {"prompt_tokens": 3, "completion_tokens": 24, "total_tokens": 27}


def test_chat_n_greedy_choices_are_the_engines(router: Router, reference: LLMEngine) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    prompt_ids = router.tokenizer.apply_chat_template(messages)
    expected = router.tokenizer.decode(greedy_ids(reference, prompt_ids, 5))
    response = call(router, lambda c, _: c.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, n=2,
        extra_body={"ignore_eos": True},
    ))  # fmt: skip
    assert [(c.index, c.message.content) for c in response.choices] == [
        (0, expected), (1, expected)
    ]  # fmt: skip
    assert response.usage is not None and response.usage.completion_tokens == 10


def test_chat_logprobs_match_the_models(router: Router, reference: LLMEngine) -> None:
    messages = [{"role": "user", "content": "Count with me"}]
    prompt_ids = router.tokenizer.apply_chat_template(messages)
    output_ids = greedy_ids(reference, prompt_ids, 6)
    response = call(router, lambda c, _: c.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=3, extra_body={"ignore_eos": True},
    ))  # fmt: skip
    content = response.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 6
    expected = expected_token_logprobs(reference.model, prompt_ids, output_ids, 3)
    for token_id, got, (logprob, top_ids, top_lps) in zip(output_ids, content, expected,
                                                          strict=True):  # fmt: skip
        assert got.token == router.tokenizer.decode([token_id], skip_special_tokens=False)
        assert got.bytes == list(got.token.encode())
        assert abs(got.logprob - logprob) <= TOL
        assert [t.token for t in got.top_logprobs] == [
            router.tokenizer.decode([t], skip_special_tokens=False) for t in top_ids
        ]
        assert max(abs(t.logprob - e) for t, e in zip(got.top_logprobs, top_lps,
                                                       strict=True)) <= TOL  # fmt: skip


def test_completion_logprobs_with_echo_cover_the_prompt(
    router: Router, reference: LLMEngine
) -> None:
    prompt_ids = [40, 41, 42, 43, 44, 45]
    output_ids = greedy_ids(reference, prompt_ids, 4)
    body = {"model": MODEL, "prompt": prompt_ids, "max_tokens": 4, "temperature": 0}
    body |= {"ignore_eos": True, "echo": True, "logprobs": 2}
    choice = post(router, "/v1/completions", body).json()["choices"][0]
    assert choice["text"].startswith(router.tokenizer.decode(prompt_ids))
    lps = choice["logprobs"]
    all_ids = prompt_ids + output_ids
    table = sequence_logprobs(reference.model, all_ids)
    assert lps["tokens"] == [router.tokenizer.decode([t], skip_special_tokens=False)
                             for t in all_ids]  # fmt: skip
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    for i in range(1, len(all_ids)):  # position i is predicted by row i - 1
        assert abs(lps["token_logprobs"][i] - float(table[i - 1, all_ids[i]])) <= TOL
        assert len(lps["top_logprobs"][i]) in (2, 3)  # the top 2, and the chosen one
    offsets = lps["text_offset"]
    assert offsets[0] == 0 and all(b >= a for a, b in zip(offsets, offsets[1:], strict=False))


def test_streamed_choices_carry_their_index_and_logprobs(
    router: Router, reference: LLMEngine
) -> None:
    prompt_ids = [50, 51, 52]
    expected = router.tokenizer.decode(greedy_ids(reference, prompt_ids, 5))
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt_ids, "max_tokens": 5, "n": 2}
    body |= {"temperature": 0, "ignore_eos": True, "logprobs": 1, "stream": True,
             "stream_options": {"include_usage": True}}  # fmt: skip
    chunks = [json.loads(e) for e in sse_events(post(router, "/v1/completions", body))[:-1]]
    texts = {0: "", 1: ""}
    num_logprobs = {0: 0, 1: 0}
    for chunk in chunks[:-1]:
        [choice] = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        num_logprobs[choice["index"]] += len(choice["logprobs"]["tokens"])
    assert texts == {0: expected, 1: expected} and num_logprobs == {0: 5, 1: 5}
    assert chunks[-1]["usage"]["completion_tokens"] == 10


def test_best_of_returns_the_most_likely_candidate(router: Router) -> None:
    body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 6, "temperature": 1.0}
    body |= {"seed": 17, "ignore_eos": True}
    # The same seed: best_of's candidates are exactly these three choices.
    candidates = post(router, "/v1/completions", body | {"n": 3, "logprobs": 0}).json()
    scores = {c["text"]: sum(c["logprobs"]["token_logprobs"]) for c in candidates["choices"]}
    best = post(router, "/v1/completions", body | {"best_of": 3}).json()
    [choice] = best["choices"]
    assert choice["text"] == max(scores, key=scores.__getitem__)
    assert choice["logprobs"] is None  # not asked for: computed for the ranking only
    assert best["usage"]["completion_tokens"] == 6


def test_logit_bias_and_penalties_reach_the_sampler(router: Router, reference: LLMEngine) -> None:
    body = {"model": MODEL, "prompt": [60, 61], "max_tokens": 5, "temperature": 0}
    body |= {"ignore_eos": True}
    forced = post(router, "/v1/completions", body | {"logit_bias": {"77": 100}}).json()
    assert forced["choices"][0]["text"] == router.tokenizer.decode([77] * 5)
    # The penalties cross the API and change the output the way the engine's own params do.
    penalties = {"presence_penalty": 2.0, "frequency_penalty": 2.0, "repetition_penalty": 1.5}
    # The prompt: one whose greedy output repeats a token three times in its first three.
    repeating = body | {"prompt": [5, 5, 5, 5], "max_tokens": 12}
    penalised = post(router, "/v1/completions", repeating | penalties).json()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, **penalties)
    [expected] = reference.generate([[5, 5, 5, 5]], params)
    assert penalised["choices"][0]["text"] == router.tokenizer.decode(expected)
    free = greedy_ids(reference, [5, 5, 5, 5], 12)
    assert len(set(free[:3])) == 1 and len(set(expected)) > len(set(free))  # fewer repeats


@pytest.mark.parametrize("choices", [{"n": 3}, {"best_of": 3}])  # best_of: each candidate
def test_every_choice_counts_for_admission(tiny_model_path: Path, choices: dict) -> None:
    router = make_router(tiny_model_path, AdmissionLimits(max_num_requests=2))
    try:
        body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 2}
        refused = post(router, "/v1/completions", body | choices)
        assert refused.status_code == 429
        assert router.client.stats().num_requests == 0  # the two admitted were given back
        assert len(post(router, "/v1/completions", body | {"n": 2}).json()["choices"]) == 2
    finally:
        router.client.shutdown()  # type: ignore[attr-defined]


@pytest.mark.parametrize("n", [1, 3])  # one choice is read without a task or queue (merge)
def test_closing_the_merged_stream_aborts_every_choice(router: Router, n: int) -> None:
    async def scenario() -> None:
        params = SamplingParams(max_tokens=500, ignore_eos=True)
        choices = [router.client.generate(f"merged-{n}-{i}", [4, 5, 6], params) for i in range(n)]
        merged = merge(choices)
        index, first = await anext(merged)
        assert 0 <= index < n and first.new_token_ids and not first.finished
        await merged.aclose()

    asyncio.run(scenario())
    deadline = time.monotonic() + 10
    while router.client.stats().num_engine_requests and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = router.client.stats()
    assert (stats.num_requests, stats.num_engine_requests, stats.kv_blocks_used) == (0, 0, 0)


def test_openai_client_reads_n_and_logprobs_streamed(router: Router) -> None:
    async def scenario(client: openai.AsyncOpenAI, _: Any) -> dict[int, int]:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=2,
            temperature=0, logprobs=True, stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        counts = {0: 0, 1: 0}
        async for chunk in stream:
            for choice in chunk.choices:
                counts[choice.index] += len(choice.logprobs.content or []) if choice.logprobs else 0
        return counts

    assert call(router, scenario) == {0: 4, 1: 4}
