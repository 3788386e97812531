"""End to end: `serve run deploy/local.yaml` (real Ray Serve, real HTTP) and the official client.

`deploy/local.yaml` is the disaggregated mesh: Router, PromptEngine, TokenEngine and 2
AttentionShards, each a Serve replica, talking over ZeroMQ and UCX. One application for the whole
package (`conftest.py`: Ray start-up is the slow part). Greedy outputs are checked against
`LLMEngine` run in this process on the same model and prompt (near-ties allowed:
`tests/e2e/greedy_check.py`), and leaks against the services' own stats (`/stats` aggregates
every engine and shard).
"""

from __future__ import annotations

import itertools
import json
import re
import time
from collections.abc import Iterator
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.serve_server import ray_pid
from common.engine.core import LLMEngine
from common.model.default import default_model_path
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer
from services.engine.worker import IDLE_REPORT_INTERVAL_S
from tests.e2e.greedy_check import assert_text_greedy_close
from tests.e2e.serve_process import OFFLINE_TITLE, ServeRun, maps_torch_and_ucxx
from tests.reference_logprobs import (
    MESH_LOGPROB_ATOL,
    expected_token_logprobs,
    sequence_logprobs,
)
from tests.unit.json_schemas import SCHEMAS, json_ending_bias

pytestmark = pytest.mark.timeout(600)

MODEL = "tiny"  # the served model: `served` pins the tiny preset over deploy/local.yaml's


@pytest.fixture(scope="module")
def client(server: ServeRun) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def greedy(reference: tuple[LLMEngine, Tokenizer], prompt_ids: list[int], n: int) -> list[int]:
    engine, _ = reference
    [output_ids] = engine.generate([prompt_ids], SamplingParams(max_tokens=n, temperature=0.0))
    assert len(output_ids) == n  # EOS would end it early; these prompts are chosen to avoid it
    return output_ids


def assert_matches(reference: tuple, text: str, prompt_ids: list[int], ref_ids: list[int]) -> None:
    assert_text_greedy_close(text, prompt_ids, ref_ids, reference[1], default_model_path("tiny"))


def test_models_and_health(server: ServeRun, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_completion_matches_engine(client: openai.OpenAI, reference: tuple) -> None:
    prompt = "The quick brown fox"
    prompt_ids = reference[1].encode(prompt)
    expected = greedy(reference, prompt_ids, 12)
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert_matches(reference, response.choices[0].text, prompt_ids, expected)
    assert response.choices[0].finish_reason == "length"
    assert response.usage is not None and response.usage.completion_tokens == 12


def test_streamed_token_id_prompt_matches_engine(client: openai.OpenAI, reference: tuple) -> None:
    prompt_ids = list(range(40, 72))
    expected = greedy(reference, prompt_ids, 10)
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt_ids,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert_matches(reference, text, prompt_ids, expected)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == 32 and chunks[-1].usage.completion_tokens == 10


def test_chat_matches_engine_streamed_and_not(client: openai.OpenAI, reference: tuple) -> None:
    messages = [{"role": "user", "content": "Say something."}]
    prompt_ids = reference[1].apply_chat_template(messages)
    expected = greedy(reference, prompt_ids, 8)
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0
    )
    assert_matches(reference, response.choices[0].message.content or "", prompt_ids, expected)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert_matches(reference, streamed, prompt_ids, expected)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_ignore_eos_and_min_tokens_force_the_length(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL,
        prompt=[5, 6, 7],
        max_tokens=40,
        extra_body={"ignore_eos": True, "min_tokens": 40, "top_k": 20, "seed": 3},
    )
    assert response.usage is not None and response.usage.completion_tokens == 40


@pytest.mark.parametrize(
    ("kwargs", "error", "param"),
    [
        ({"max_tokens": -1}, openai.BadRequestError, "max_tokens"),
        ({"model": "no-such-model"}, openai.NotFoundError, "model"),
        ({"prompt": [7] * 4090, "max_tokens": 100}, openai.BadRequestError, "max_tokens"),
        ({"prompt": [7] * 5000}, openai.BadRequestError, "prompt"),
        ({"temperature": "hot"}, openai.BadRequestError, "temperature"),
    ],
)
def test_bad_input_gets_openai_error(
    client: openai.OpenAI, kwargs: dict, error: type, param: str
) -> None:
    request = {"model": MODEL, "prompt": "hi", "max_tokens": 4} | kwargs
    with pytest.raises(error) as info:
        client.completions.create(**request)
    assert info.value.body["param"] == param
    assert info.value.body["code"] == info.value.status_code


@pytest.mark.parametrize(
    "content",
    [b'{"model": "tiny", "prompt": ', b'{"model": "tiny", "prompt": "x", "stream": "yes"}', b"[]"],
)
def test_malformed_body_is_400(server: ServeRun, content: bytes) -> None:
    response = httpx.post(
        server.base_url + "/v1/completions",
        content=content,
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def stats(server: ServeRun) -> dict:
    return httpx.get(server.base_url + "/stats").json()


def test_client_disconnect_frees_kv(server: ServeRun) -> None:
    body = {"model": MODEL, "prompt": [9] * 100, "max_tokens": 3000, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as response:
            # NOTE: keep the line iterator referenced: dropping it closes the connection early.
            lines = response.iter_lines()
            assert sum(line.startswith("data:") for line in itertools.islice(lines, 20)) >= 5
            running = stats(server)
            # The request is still generating (a 3000-token request cannot be done yet), with
            # its KV on the attention shards.
            assert running["num_requests"] == 1 and running["kv_blocks_used"] > 0, (
                f"{running}\n{server.log_tail()}"
            )
            shards = [s for s in running["services"].values() if s["role"] == "shard"]
            assert len(shards) == 2 and all(s["kv_blocks_used"] > 0 for s in shards), running
    # The stream is closed: the proxy cancels the replica's handler, which aborts the request.
    deadline = time.monotonic() + 20
    while (current := stats(server))["kv_blocks_used"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert current["kv_blocks_used"] == 0 and current["num_engine_requests"] == 0
    assert all(s["kv_blocks_used"] == 0 for s in current["services"].values()), current


def wait_until_no_kv(server: ServeRun, timeout_s: float = 20) -> dict:
    deadline = time.monotonic() + timeout_s
    while (current := stats(server))["kv_blocks_used"] and time.monotonic() < deadline:
        time.sleep(0.2)  # NOTE: the abort travels router -> engines -> shards asynchronously
    return current


def test_stop_string_ends_the_request_and_frees_the_mesh(
    server: ServeRun, client: openai.OpenAI, reference: tuple
) -> None:
    prompt_ids = list(range(300, 330))
    text = reference[1].decode(greedy(reference, prompt_ids, 40))
    stop = text[12:15]
    expected = text[: text.find(stop)]
    response = client.completions.create(
        model=MODEL, prompt=prompt_ids, max_tokens=2000, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert response.choices[0].text == expected
    assert response.choices[0].finish_reason == "stop"
    # The engines would go on to 2000 tokens: the router's abort is what frees the KV.
    current = wait_until_no_kv(server)
    assert current["kv_blocks_used"] == 0 and current["num_engine_requests"] == 0, current


def sample_values(exposition: str, name: str) -> list[float]:
    """Every sample of `name` in Prometheus text format (one per label set)."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", re.MULTILINE)
    return [float(value) for value in pattern.findall(exposition)]


# Histograms recorded by the Router replica (client-facing), the PromptEngine (its phases) and
# the TokenEngine (its shard round trips, sampled).
RAY_HISTOGRAMS = (
    "ray_phasemesh_time_to_first_token_seconds",
    "ray_phasemesh_inter_token_latency_seconds",
    "ray_phasemesh_e2e_request_latency_seconds",
    "ray_phasemesh_request_prefill_time_seconds",
    "ray_phasemesh_shard_round_trip_seconds",
)


def test_ray_metrics_endpoint_has_the_latency_histograms(
    server: ServeRun, client: openai.OpenAI
) -> None:
    stream = client.completions.create(
        model=MODEL, prompt=[21] * 40, max_tokens=8, extra_body={"ignore_eos": True}, stream=True
    )
    # NOTE: tokens that reach the router together leave as one chunk (a loaded machine): 8 or fewer.
    num_chunks = len([chunk for chunk in stream if chunk.choices])
    assert 2 <= num_chunks <= 8
    url = server.ray_metrics_url()
    # Ray's workers report to its metrics agent every few seconds: poll, bounded.
    deadline = time.monotonic() + 90
    while True:
        exposition = httpx.get(url, timeout=10).text
        counts = {name: sum(sample_values(exposition, name + "_count")) for name in RAY_HISTOGRAMS}
        if all(counts.values()) or time.monotonic() > deadline:
            break
        time.sleep(2)  # NOTE: waiting on Ray's report interval; nothing to block on
    assert all(counts.values()), counts
    itl = sum(sample_values(exposition, "ray_phasemesh_inter_token_latency_seconds_count"))
    assert itl >= num_chunks - 1
    blocks = sample_values(exposition, "ray_phasemesh_kv_blocks_used")
    assert len(blocks) >= 3, "the engines and both shards set the KV blocks gauge"
    trips = sample_values(exposition, "ray_phasemesh_shard_round_trip_seconds_count")
    assert len(trips) == 2, "one round-trip histogram per shard of the group"


def vllm_totals(url: str) -> dict[str, float]:
    """The router's /metrics, parsed (prometheus-client's parser rejects a malformed line): each
    sample name's sum over label sets, and the engines that report gauges."""
    exposition = httpx.get(url + "/metrics", timeout=10)
    assert exposition.status_code == 200
    totals: dict[str, float] = {}
    engines = set()
    for family in text_string_to_metric_families(exposition.text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
            if sample.name == "vllm:kv_cache_usage_perc":
                assert 0 <= sample.value <= 1
                engines.add(sample.labels["engine"])
    totals["engines"] = len(engines)
    return totals


def settled_vllm_totals(url: str, deadline_s: float = 30.0) -> dict[str, float]:
    """The totals once nothing runs and two reads an idle engine's report interval apart agree:
    what earlier tests' requests leave counting (an abort the engines finish later) is in."""

    def counts(totals: dict[str, float]) -> dict[str, float]:
        return {k: v for k, v in totals.items() if k.startswith("vllm:") and k.endswith("_count")}

    deadline = time.monotonic() + deadline_s
    last = vllm_totals(url)
    while time.monotonic() < deadline:
        time.sleep(IDLE_REPORT_INTERVAL_S + 0.5)  # NOTE: waiting on the engines' idle reports
        now = vllm_totals(url)
        if counts(now) == counts(last) and now.get("vllm:num_requests_running", 1) == 0:
            return now
        last = now
    return last


def test_router_metrics_endpoint_has_vllm_series(server: ServeRun, client: openai.OpenAI) -> None:
    before = settled_vllm_totals(server.base_url)
    prompt = [23] * 40
    client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, extra_body={"ignore_eos": True}
    )
    # The router's own series are recorded as the response ends; the engines' arrive with their
    # next load report (every 50 ms), and the report that counts the last step may still count
    # the request as running: poll until a later one, bounded.
    deadline = time.monotonic() + 30
    while True:
        after = vllm_totals(server.base_url)
        grown = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        reported = grown.get("vllm:iteration_tokens_total_count", 0) >= 4
        if reported and after.get("vllm:num_requests_running", 1) == 0:
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)  # NOTE: waiting on the engines' report interval
    assert grown["vllm:time_to_first_token_seconds_count"] == 1
    assert grown["vllm:e2e_request_latency_seconds_count"] == 1
    assert grown["vllm:prompt_tokens_total"] == 40 and grown["vllm:generation_tokens_total"] == 4
    assert grown["vllm:request_success_total"] == 1
    assert grown["vllm:request_prompt_tokens_sum"] == 40
    assert after["engines"] >= 2, "the prompt and the token engine report"
    assert after["vllm:num_requests_running"] == 0
    assert grown["vllm:prefix_cache_queries_total"] >= 40  # the prompt engine looked it up
    # The prefill (40 tokens) on the prompt engine, 3 decode steps on the token engine.
    assert grown["vllm:iteration_tokens_total_count"] >= 4
    assert grown["vllm:iteration_tokens_total_sum"] >= 43
    # Its phases, timed by the engines (vLLM's dashboards plot these).
    for phase in ("queue", "prefill", "decode"):
        assert grown[f"vllm:request_{phase}_time_seconds_count"] == 1
    # The same registry through Serve's proxy, and open like /health.
    assert vllm_totals(server.proxy_url)["vllm:request_success_total"] >= 1


def test_n_choices_and_logprobs_over_the_mesh(client: openai.OpenAI, reference: tuple) -> None:
    """n fans out into engine requests across the mesh; greedy logprobs (first token from the
    prompt engine, the rest from the token engine) match the model's own log_softmax."""
    engine, tokenizer = reference
    prompt_ids = list(range(80, 96))
    output_ids = greedy(reference, prompt_ids, 6)
    response = client.completions.create(
        model=MODEL, prompt=prompt_ids, max_tokens=6, temperature=0, n=3, logprobs=3,
        echo=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert response.usage is not None and response.usage.completion_tokens == 18
    all_ids = prompt_ids + output_ids
    table = sequence_logprobs(engine.model, all_ids)
    for choice in response.choices:
        lps = choice.logprobs
        assert lps is not None and lps.token_logprobs is not None and lps.tokens is not None
        assert lps.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in all_ids]
        assert lps.token_logprobs[0] is None  # nothing predicts the first prompt token
        for i in range(1, len(all_ids)):
            assert abs(lps.token_logprobs[i] - float(table[i - 1, all_ids[i]])) <= MESH_LOGPROB_ATOL
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=2, n=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chat_prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    chat_ids = greedy(reference, chat_prompt, 4)
    expected = expected_token_logprobs(engine.model, chat_prompt, chat_ids, 2)
    for choice in chat.choices:
        content = choice.logprobs.content if choice.logprobs else None
        assert content is not None and len(content) == 4
        for got, (logprob, _, top_lps) in zip(content, expected, strict=True):
            assert abs(got.logprob - logprob) <= MESH_LOGPROB_ATOL
            assert [
                abs(t.logprob - e) <= MESH_LOGPROB_ATOL
                for t, e in zip(got.top_logprobs, top_lps, strict=True)
            ] == [True, True]


def test_structured_outputs_validate_over_the_mesh(client: openai.OpenAI, reference: tuple) -> None:
    """`response_format` through the official client: the prompt engine samples the first token
    under the grammar, the token engine the rest (its matcher rebuilt from the hand-off). Every
    one of the 20 schemas' outputs validates; json_object parses to an object. The logit_bias
    makes the random model's JSON end (`json_ending_bias`)."""
    engine, tokenizer = reference
    bias = json_ending_bias(tokenizer, engine.model_config.eos_token_ids)
    logit_bias = {str(token_id): int(b) for token_id, b in bias.items()}
    messages = [{"role": "user", "content": "Reply in JSON"}]
    for name, schema in SCHEMAS.items():
        json_schema = {"name": name, "schema": schema}
        response = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=200, temperature=0, logit_bias=logit_bias,
            response_format={"type": "json_schema", "json_schema": json_schema},
        )  # fmt: skip
        choice = response.choices[0]
        assert choice.finish_reason == "stop", name
        jsonschema.validate(json.loads(choice.message.content or ""), schema)
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=200, temperature=0, logit_bias=logit_bias,
        response_format={"type": "json_object"},
    )  # fmt: skip
    assert isinstance(json.loads(response.choices[0].message.content or ""), dict)


def test_batch_api_gives_the_online_apis_greedy_outputs(client: openai.OpenAI) -> None:
    """The Batch API over the served mesh: upload, create, poll, read the output, cancel. (Plain
    greedy chats: the offline group answers them; each equals the online API's answer.)"""
    bodies = [{"model": "tiny", "messages": [{"role": "user", "content": f"item {i}"}],
               "max_tokens": 5, "temperature": 0} for i in range(4)]  # fmt: skip
    rows = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": b}
            for i, b in enumerate(bodies)]  # fmt: skip
    data = "\n".join(json.dumps(r) for r in rows).encode()
    uploaded = client.files.create(file=("chat.jsonl", data), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")  # fmt: skip
    deadline = time.monotonic() + 120
    while (batch := client.batches.retrieve(batch.id)).status != "completed":
        assert batch.status in ("validating", "in_progress", "finalizing"), batch.status
        assert time.monotonic() < deadline
        time.sleep(0.3)
    assert batch.request_counts.completed == 4 and batch.error_file_id is None
    assert batch.output_file_id is not None
    out = [json.loads(line) for line in client.files.content(batch.output_file_id).text.split("\n")
           if line]  # fmt: skip
    assert [r["custom_id"] for r in out] == ["c0", "c1", "c2", "c3"]
    for record, body in zip(out, bodies, strict=True):
        online = client.chat.completions.create(**body)
        batched = record["response"]["body"]["choices"][0]["message"]["content"]
        assert batched == online.choices[0].message.content
    # Cancelling a finished batch changes nothing; the endpoint answers with the batch.
    assert client.batches.cancel(batch.id).status == "completed"
    # Cancelling one as it starts stops it: the lines that finished are kept, each once. (`top_p`
    # keeps it on the online API, line by line: an offline group's job is not cut midway.)
    rows = [{"custom_id": f"x{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {**bodies[i % 4], "max_tokens": 32, "top_p": 0.9}}
            for i in range(40)]  # fmt: skip
    uploaded = client.files.create(file=("x.jsonl", "\n".join(json.dumps(r) for r in rows)
                                         .encode()), purpose="batch")  # fmt: skip
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")  # fmt: skip
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    while (batch := client.batches.retrieve(batch.id)).status == "cancelling":
        assert time.monotonic() < deadline + 120
        time.sleep(0.3)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    kept = [] if batch.output_file_id is None else [
        json.loads(line) for line in client.files.content(batch.output_file_id).text.split("\n")
        if line]  # fmt: skip
    ids = [r["custom_id"] for r in kept]
    assert len(set(ids)) == len(ids) == batch.request_counts.completed < 40
    assert set(ids) <= {r["custom_id"] for r in rows}


def test_a_greedy_completions_batch_runs_on_seesaws_offline_group(
    server: ServeRun, client: openai.OpenAI
) -> None:
    """deploy/local.yaml's `offline:` group takes a batch of plain greedy completions as one job
    (its replica logs it); each output equals the online API's."""
    bodies = [{"model": "tiny", "prompt": f"offline {i} is", "max_tokens": 4 + i,
               "temperature": 0} for i in range(5)]  # fmt: skip
    rows = [{"custom_id": f"o{i}", "method": "POST", "url": "/v1/completions", "body": b}
            for i, b in enumerate(bodies)]  # fmt: skip
    uploaded = client.files.create(file=("o.jsonl", "\n".join(json.dumps(r) for r in rows)
                                         .encode()), purpose="batch")  # fmt: skip
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                  completion_window="24h")  # fmt: skip
    deadline = time.monotonic() + 180
    while (batch := client.batches.retrieve(batch.id)).status != "completed":
        assert time.monotonic() < deadline, batch.status
        time.sleep(0.3)
    assert batch.output_file_id is not None
    out = [json.loads(line) for line in client.files.content(batch.output_file_id).text.split("\n")
           if line]  # fmt: skip
    for record, body in zip(out, bodies, strict=True):
        online = client.completions.create(**body)
        assert record["response"]["body"]["choices"][0]["text"] == online.choices[0].text
    assert "offline job done" in server.log_tail(200_000)
    # Its replica, started by a job (the group scales to zero), computes nothing itself: its
    # worker processes do. It never loaded torch or UCX.
    assert server.pid is not None
    offline = ray_pid(server.pid, OFFLINE_TITLE)
    assert offline is not None
    assert maps_torch_and_ucxx(offline) == (False, False)


class GetWeather(pydantic.BaseModel):
    """A tool as the official client's docs define one (`openai.pydantic_function_tool`)."""

    city: str = pydantic.Field(max_length=10)
    unit: Literal["c", "f"]


def test_tool_calls_validate_over_the_mesh_streamed_and_not(client: openai.OpenAI) -> None:
    """Issue 51's acceptance: `tools` with `tool_choice="required"` and with a named function
    return `tool_calls` whose arguments validate against the schema, streamed (the client's own
    stream helper accumulates the deltas) and not; a grammar held across the prompt engine's
    first token and the token engine's rest."""
    tool = openai.pydantic_function_tool(GetWeather)
    schema = tool["function"]["parameters"]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "GetWeather"}}
    for seed, tool_choice in enumerate(("required", named)):
        kwargs = dict(model=MODEL, messages=messages, tools=[tool], tool_choice=tool_choice,
                      max_tokens=100, seed=seed)  # fmt: skip
        message = client.chat.completions.create(**kwargs).choices[0].message
        with client.chat.completions.stream(**kwargs) as stream:
            streamed = stream.get_final_completion().choices[0].message
        for calls in (message.tool_calls, streamed.tool_calls):
            assert calls and all(call.function.name == "GetWeather" for call in calls)
            for call in calls:
                jsonschema.validate(json.loads(call.function.arguments), schema)
        # The same seed samples the same tokens: the same arguments, streamed or not.
        assert [c.function.arguments for c in streamed.tool_calls] == [
            c.function.arguments for c in message.tool_calls
        ]
        assert isinstance(streamed.tool_calls[0].function.parsed_arguments, GetWeather)


def test_vllm_structured_outputs_and_unknown_fields(
    server: ServeRun, client: openai.OpenAI, reference: tuple
) -> None:
    """vLLM's current `structured_outputs` through the official client's `extra_body`, over the
    mesh: a schema's JSON validates, a regex matches, a choice is one of them, a Lark grammar's
    text parses. An unknown field is answered (200), listed back in `X-Ignored-Fields` and logged
    by the router (`strict_fields` refuses it instead: tests/unit/test_api_fields.py)."""
    engine, tokenizer = reference
    bias = json_ending_bias(tokenizer, engine.model_config.eos_token_ids)
    logit_bias = {str(token_id): int(b) for token_id, b in bias.items()}
    messages = [{"role": "user", "content": "Reply"}]
    schema = SCHEMAS["nested_object"]

    def chat(structured: dict, **fields: object) -> str:
        response = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=200, temperature=0,
            extra_body={"structured_outputs": structured}, **fields,  # type: ignore[arg-type]
        )  # fmt: skip
        return response.choices[0].message.content or ""

    jsonschema.validate(json.loads(chat({"json": schema}, logit_bias=logit_bias)), schema)
    assert re.fullmatch(r"[a-f]{2,4}-[0-9]{3}", chat({"regex": r"[a-f]{2,4}-[0-9]{3}"}))
    assert chat({"choice": ["alpha", "beta", "gamma"]}) in ("alpha", "beta", "gamma")
    lark = 'start: "x=" NUM ("," NUM)*\nNUM: /[0-9]{1,3}/'
    assert re.fullmatch(r"x=[0-9]{1,3}(,[0-9]{1,3})*", chat({"grammar": lark}))
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="hi", max_tokens=2, extra_body={"e2e_unknown_field": 1}
    )
    assert raw.http_response.status_code == 200
    assert raw.headers["X-Ignored-Fields"] == "e2e_unknown_field"
    deadline = time.monotonic() + 30
    while "e2e_unknown_field" not in server.log_tail(200_000) and time.monotonic() < deadline:
        time.sleep(0.5)  # the replica's log reaches `serve run`'s output a moment later
    assert "request fields ignored" in server.log_tail(200_000)
