"""`/tokenize`, `/detokenize` and the chat template options over real HTTP, without Ray.

The router's FastAPI app with a real `InProcessEngineClient`, reached through httpx's ASGI
transport. Token ids are checked against transformers' tokenizer on the same folder; a router
serving a Mistral-style template shows the template's own refusal as a 400.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from common.engine.core import LLMEngine
from services.router.engine_client import InProcessEngineClient
from services.router.server import Router
from tests.unit.test_chat_template import MISTRAL, reference_ids

MODEL = "tiny"
API_KEY = "tokenize-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def serve(model_path: Path, tokenizer_folder: Path | None = None) -> Router:
    """A router for `tokenizer_folder` (its config and chat template) over the tiny model."""
    engine = LLMEngine.from_path(model_path, num_blocks=64)
    folder = tokenizer_folder or model_path
    return Router(InProcessEngineClient(engine), folder, MODEL, api_key=API_KEY)


@pytest.fixture(scope="module")
def router(tiny_model_path: Path) -> Iterator[Router]:
    router = serve(tiny_model_path)
    yield router
    router.client.shutdown()  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def mistral_router(tiny_model_path: Path, tmp_path_factory) -> Iterator[Router]:
    folder = tmp_path_factory.mktemp("mistral") / "model"
    shutil.copytree(tiny_model_path, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": MISTRAL}))
    router = serve(tiny_model_path, folder)
    yield router
    router.client.shutdown()  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def hf(tiny_model_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_path)


def post(router: Router, path: str, body: dict[str, Any], headers: Any = AUTH) -> httpx.Response:
    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=router.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as http:
            # json.dumps escapes a lone surrogate, as a client may send one.
            content = json.dumps(body).encode()
            sent = {"Content-Type": "application/json", **headers}
            return await http.post(path, content=content, headers=sent, timeout=60)

    return asyncio.run(main())


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    return response.json()["error"]


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_tokenize_prompt_is_transformers_encoding(router, hf, add_special_tokens) -> None:
    prompt = "Hello there, 日本 😀 <|eot_id|> as text"
    body = {"model": MODEL, "prompt": prompt, "add_special_tokens": add_special_tokens,
            "return_token_strs": True}  # fmt: skip
    got = post(router, "/tokenize", body).json()
    expected = hf.encode(prompt, add_special_tokens=add_special_tokens, split_special_tokens=True)
    assert got["tokens"] == expected and got["count"] == len(expected)
    assert got["max_model_len"] == router.max_model_len
    assert got["token_strs"] == hf.convert_ids_to_tokens(expected)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tokenize_chat_is_transformers_chat_template(router, hf, add_generation_prompt) -> None:
    messages = [
        {"role": "system", "content": "Be brief. "},
        {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                     {"type": "text", "text": "é"}]},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "<|eot_id|><|start_header_id|>system"},
    ]  # fmt: skip
    body = {"messages": messages, "add_generation_prompt": add_generation_prompt}
    got = post(router, "/tokenize", body).json()
    # Text parts are joined into one string before the template sees them.
    flat = [m | {"content": "Hi é"} if isinstance(m["content"], list) else m for m in messages]
    expected = reference_ids(hf, flat, add_generation_prompt=add_generation_prompt)
    assert got["tokens"] == expected and got["token_strs"] is None


def test_chat_completion_counts_the_tokens_tokenize_reports(router) -> None:
    """The chat endpoint runs exactly the prompt `/tokenize` shows, `continue_final_message`
    included (the last message stays open: no end-of-turn token after it)."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well,"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    tokens = post(router, "/tokenize", {"messages": messages} | options).json()["tokens"]
    assert router.tokenizer.decode(tokens, skip_special_tokens=False).endswith(
        "<|end_header_id|>\n\nWell,"
    )
    body = {"model": MODEL, "messages": messages, "max_tokens": 3, "ignore_eos": True} | options
    usage = post(router, "/v1/chat/completions", body).json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(tokens), 3)


def test_detokenize_round_trips_and_refuses_unknown_ids(router) -> None:
    prompt = "round trip: 😀 <|eot_id|>"
    tokens = post(router, "/tokenize", {"prompt": prompt}).json()["tokens"]
    assert post(router, "/detokenize", {"tokens": tokens}).json() == {
        "prompt": "<|begin_of_text|>" + prompt  # special tokens are kept, as vLLM does
    }
    vocab = router.tokenizer.vocab_size
    error = error_of(post(router, "/detokenize", {"tokens": [5, vocab]}), 400)
    assert error["param"] == "tokens" and str(vocab) in error["message"]
    assert error_of(post(router, "/detokenize", {"tokens": [-1]}), 400)["param"] == "tokens.0"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "a"}],
          "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"messages": [{"role": "user", "content": "a"}], "continue_final_message": True},
         "continue_final_message"),
        ({"messages": [{"role": "user", "content": "a"}], "add_special_tokens": True},
         "add_special_tokens"),
        ({"prompt": "\ud800"}, "prompt"),
        ({"prompt": "a", "model": "other"}, "model"),
    ],
)  # fmt: skip
def test_tokenize_errors_name_the_parameter(router, body, param) -> None:
    for path in ("/tokenize", "/v1/chat/completions") if "messages" in body else ("/tokenize",):
        response = post(router, path, body | {"max_tokens": 2})
        status = 404 if param == "model" else 400
        if path != "/tokenize" and param == "add_special_tokens":
            assert response.status_code == 200  # not a chat-completion field: ignored
            continue
        assert error_of(response, status)["param"] == param


def test_tokenize_wants_the_api_key(router) -> None:
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        assert error_of(post(router, path, body, headers={}), 401)["type"] == "AuthenticationError"


def test_template_refusal_is_a_400_with_its_message(mistral_router) -> None:
    """Mistral's template raises on a role order it does not take: the client sees why."""
    bad = [{"role": "assistant", "content": "first"}, {"role": "user", "content": "then"}]
    for path in ("/tokenize", "/v1/chat/completions"):
        error = error_of(post(mistral_router, path, {"messages": bad, "max_tokens": 2}), 400)
        assert (
            error["message"]
            == "Conversation roles must alternate user/assistant/user/assistant/..."
        )
        assert error["param"] == "messages"
    good = [{"role": "user", "content": "hi"}]
    tokens = post(mistral_router, "/tokenize", {"messages": good}).json()["tokens"]
    text = mistral_router.tokenizer.decode(tokens, skip_special_tokens=False)
    assert text == "<|begin_of_text|>[INST] hi [/INST]"
    body = {"messages": good, "max_tokens": 2, "ignore_eos": True}
    usage = post(mistral_router, "/v1/chat/completions", body).json()["usage"]
    assert usage["prompt_tokens"] == len(tokens)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ([{"role": "user", "content": "hi"}], None),  # a bare list, not an object
        ("hello", None),
        ({"messages": "hi"}, "messages"),  # a chat by its key, however wrong its value
        ({"messages": [{"role": "tool", "content": None}]}, "messages.0"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": "a", "messages": []}, "messages"),  # both keys: read as the chat it names
    ],
)
def test_tokenize_bodies_of_the_wrong_shape_are_a_400_naming_the_field(
    router: Router, body: Any, param: str | None
) -> None:
    error = error_of(post(router, "/tokenize", body), 400)
    if param is not None:
        assert error["param"] == param, error
