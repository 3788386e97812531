"""Issue 51's acceptance on `make run` itself: `serve run deploy/local.yaml` as printed, on its
real model (SmolLM2-135M-Instruct, served as `smollm2`), through the official `openai` client.

The suite checks the same paths on the tiny random preset (tests/e2e/local_serve/), whose
answers no reader can judge; this module is the real model's, opt-in because a 30-layer model
on a shared 2-core machine takes minutes of the suite's budget:

    PHASEMESH_E2E_MAKE_RUN=1 pytest -rA tests/e2e/test_make_run.py

SmolLM2 must be in the model cache or downloadable (`make model`). README's served blocks run
as printed (the chat answer is the single-process engine's greedy one, which
tests/integration/test_smollm2.py holds equal to transformers'); vLLM's `structured_outputs`
(json, regex, choice, grammar) and an unknown field; `tools` with `tool_choice="required"` and
a named function, streamed and not; `/metrics` in vLLM's names through Serve's proxy (`:8000`
in `make run`) and direct ingress; docs/loadgen.md's chat closed loop of 20 requests; and where
AIPerf is installed (`$PHASEMESH_AIPERF`), bench/loadgen_aiperf.py's comparison.
"""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.loadgen_aiperf import Slice, compare, find_aiperf
from common.config import env
from common.model.default import real_model_path
from loadgen.traces import shared_dir
from tests.e2e.local_serve.test_chat_capacity import NUM_CHATS, chat
from tests.e2e.local_serve.test_docs_commands import SERVED, check, run_block
from tests.e2e.serve_process import REPO, ServeRun, served

pytestmark = [
    pytest.mark.timeout(1800),
    pytest.mark.skipif(
        env("E2E_MAKE_RUN") != "1", reason="the real model's e2e: PHASEMESH_E2E_MAKE_RUN=1"
    ),
]

MODEL = "smollm2"
AIPERF = find_aiperf()
ANSWER = "The capital of France is Paris."  # LLMEngine's greedy answer (test_smollm2.py)
TRACE = shared_dir() / "traces" / "AzureLLMInferenceTrace_conv.csv"
# The list: what vLLM's dashboards read, beside the latency histograms.
VLLM_SERIES = (
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:iteration_tokens_total_bucket",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeRun]:
    real_model_path(MODEL)  # converted once here, not by replicas starting at once
    with served("local.yaml", tmp_path_factory.mktemp("make-run"), preset=None) as run:
        assert run.config["applications"][0]["args"]["model"] == MODEL  # deploy/local.yaml's
        yield run


@pytest.fixture(scope="module")
def client(server: ServeRun) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_readme_blocks_run_and_answer_sensibly(server: ServeRun, client: openai.OpenAI) -> None:
    readme = [block for block in SERVED if block.path.name == "README.md"]
    assert any("capital of France" in block.code for block in readme)
    for block in readme:
        result = run_block(block, server)
        print(block.name, result.stdout[-2000:], sep="\n")  # what a reader sees, for `-rA`
        check(block, result)
        if "capital of France" in block.code:
            assert "Paris" in result.stdout, block.name
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32, temperature=0,
    )  # fmt: skip
    assert chat.choices[0].message.content == ANSWER


def test_structured_outputs_and_unknown_fields(server: ServeRun, client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "country": {"type": "string", "maxLength": 24},
        },
        "required": ["city", "country"],
        "additionalProperties": False,
    }

    def chat(question: str, structured: dict) -> str:
        response = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=64,
            temperature=0, extra_body={"structured_outputs": structured},
        )  # fmt: skip
        text = response.choices[0].message.content or ""
        print(structured, repr(text))
        return text

    city = json.loads(
        chat("Name the capital of France and its country, in JSON.", {"json": schema})
    )
    jsonschema.validate(city, schema)
    assert re.fullmatch(
        r"[A-Z][a-z]{2,15}", chat("The capital of France?", {"regex": r"[A-Z][a-z]{2,15}"})
    )
    choices = ["Paris", "London", "Berlin"]
    assert chat("What is the capital of France?", {"choice": choices}) in choices
    lark = 'start: "x=" NUM ("," NUM)*\nNUM: /[0-9]{1,3}/'
    assert re.fullmatch(r"x=[0-9]{1,3}(,[0-9]{1,3})*", chat("List numbers.", {"grammar": lark}))

    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        extra_body={"make_run_unknown_field": 1},
    )  # fmt: skip
    assert raw.http_response.status_code == 200
    assert raw.headers["X-Ignored-Fields"] == "make_run_unknown_field"
    deadline = time.monotonic() + 60
    while "make_run_unknown_field" not in server.log_tail(400_000):
        assert time.monotonic() < deadline, "the router never logged the ignored field"
        time.sleep(0.5)  # the replica's log reaches `serve run`'s output a moment later


class GetWeather(pydantic.BaseModel):
    """A tool as the official client's docs define one (`openai.pydantic_function_tool`)."""

    city: str = pydantic.Field(max_length=24)
    unit: Literal["celsius", "fahrenheit"]


def test_tool_calls_validate_streamed_and_not(client: openai.OpenAI) -> None:
    tool = openai.pydantic_function_tool(GetWeather)
    schema = tool["function"]["parameters"]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "GetWeather"}}
    for tool_choice in ("required", named):
        kwargs = dict(model=MODEL, messages=messages, tools=[tool], tool_choice=tool_choice,
                      max_tokens=100, temperature=0)  # fmt: skip
        message = client.chat.completions.create(**kwargs).choices[0].message  # type: ignore[call-overload]
        with client.chat.completions.stream(**kwargs) as stream:  # type: ignore[arg-type]
            streamed = stream.get_final_completion().choices[0].message
        for calls in (message.tool_calls, streamed.tool_calls):
            assert calls and all(call.function.name == "GetWeather" for call in calls)
            for call in calls:
                print(tool_choice, call.function.arguments)
                jsonschema.validate(json.loads(call.function.arguments), schema)
        assert [c.function.arguments for c in streamed.tool_calls or []] == [
            c.function.arguments for c in message.tool_calls or []
        ]  # greedy: the same call, streamed or not


def test_metrics_in_vllm_names_after_requests(server: ServeRun, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="Paris is", max_tokens=8, temperature=0)
    for url in (server.proxy_url, server.base_url):  # :8000 under `make run`, and :30000
        exposition = httpx.get(url + "/metrics", timeout=30)
        assert exposition.status_code == 200
        samples = [s for f in text_string_to_metric_families(exposition.text) for s in f.samples]
        names = {sample.name for sample in samples}
        assert set(VLLM_SERIES) <= names, set(VLLM_SERIES) - names
        total = {name: sum(s.value for s in samples if s.name == name) for name in names}
        assert total["vllm:request_success_total"] >= 1 and total["vllm:prompt_tokens_total"] > 0
        assert total["vllm:prefix_cache_queries_total"] > 0
        engines = {s.labels["engine"] for s in samples if s.name == "vllm:kv_cache_usage_perc"}
        assert len(engines) >= 2, "the prompt and the token engine report"


@pytest.mark.timeout(3600)  # eight stories to the context's end, two at a time: tens of minutes
def test_eight_chats_without_max_tokens_finish_or_are_refused_before_streaming(
    server: ServeRun,
) -> None:
    """Issue 49's first item as a new user met it: eight concurrent streamed greedy chats without
    `max_tokens` (the official client's default). SmolLM2 tells each story for thousands of
    tokens (to the end of its 8,192-token context, most of them), past what the shard group
    holds for all eight (16,384 tokens), so the token engine preempts and recomputes (a chunk a
    step: services/engine/prefill_chunks.py) and a preempted stream waits, kept alive by SSE
    comments, for minutes. With the official client's default timeouts every chat ends `stop`
    or `length`, or is refused before its first chunk; none fails mid-stream."""
    with ThreadPoolExecutor(NUM_CHATS) as pool:
        stories = [f"Tell me a story, {i}." for i in range(NUM_CHATS)]
        ends = list(pool.map(lambda content: chat(server, content, MODEL), stories))
    print(ends, httpx.get(server.base_url + "/stats", timeout=60).json()["services"])
    assert set(ends) <= {"length", "stop", "refused 429", "refused 503"}, ends
    assert ends.count("length") + ends.count("stop") >= 4, ends


def test_loadgen_chat_closed_loop_of_20(server: ServeRun, tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "loadgen", "replay", "--trace", str(TRACE),
        "--url", server.base_url, "--endpoint", "chat", "--max-concurrency", "4",
        "--num-requests", "20", "--request-rate", "inf", "--token-scale", "1/2",
        "--output-token-scale", "1/16", "--warmup", "2", "--out", str(tmp_path), "--no-plots",
        "--disable-tqdm",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1200)
    print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
    assert done.returncode == 0
    summary = json.loads((tmp_path / "results.json").read_text())
    assert (summary["completed"], summary["failed"]) == (20, 0), summary["errors"]
    assert summary["endpoint"] == "/v1/chat/completions" and summary["max_concurrency"] == 4
    assert summary["model_id"] == MODEL and summary["base_url"] == server.base_url
    assert summary["trace"] == str(TRACE) and summary["request_rate"] == "inf"
    assert summary["usage_mismatches"] == {"prompt_tokens": 0, "completion_tokens": 0,
                                           "no_usage": 0}  # fmt: skip
    with open(tmp_path / "requests.csv", newline="") as f:
        assert [int(row["req_index"]) for row in csv.DictReader(f)] == list(range(20))


@pytest.mark.skipif(AIPERF is None, reason="aiperf is not installed ($PHASEMESH_AIPERF)")
def test_loadgen_and_aiperf_agree_on_make_run(server: ServeRun, tmp_path: Path) -> None:
    """bench/loadgen_aiperf.py's comparison on the real mesh, its default slice, three
    alternating rounds (their median: one round that a busy machine slowed does not decide);
    the last printed line is the bench's JSON (docs/benchmarks/ records runs)."""
    assert AIPERF is not None
    folder = str(real_model_path(MODEL))
    result = compare(server.base_url, folder, AIPERF, Slice(), tmp_path, rounds=3)
    print(json.dumps(result))
    assert result["loadgen_completed"] == result["aiperf_completed"] == 3 * Slice().num_requests
    assert all(result["targets_met"].values()), result
