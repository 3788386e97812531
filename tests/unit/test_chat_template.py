"""Chat templates render and encode as transformers' `apply_chat_template` does.

The reference is transformers itself (`AutoTokenizer.from_pretrained` on the same folder), with
`sanitize_control_tokens=True`: our role-injection protection is that option, always on. The
templates are the default model's and real-world shapes whose whitespace control decides the
tokens (Llama-3's, ChatML/Qwen's `{%- ... -%}`, Mistral's role check that raises).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jinja2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer
from transformers import AutoTokenizer

from common.chat_template import ChatTemplateError
from common.tokenizer import BOS, EOS, Tokenizer

# Llama-3-8B-Instruct's template as shipped.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
# Qwen-style ChatML: `{%- -%}` trimming, a default system turn, a chat_template_kwargs switch,
# namespace(), loop controls, tojson and a non-special added token the template writes.
CHATML = """{%- set ns = namespace(system=false) -%}
{%- for message in messages -%}
    {%- if message['role'] == 'system' -%}{%- set ns.system = true -%}{%- endif -%}
{%- endfor -%}
{%- if not ns.system %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
{% endif -%}
{%- for message in messages %}
    {%- if message['content'] == 'skip me' %}{% continue %}{% endif %}
<|im_start|>{{ message['role'] }}
{% if message['role'] == 'assistant' %}<tool_call>{{ {'n': loop.index} | tojson }}
{% endif %}{{ message['content'] }}<|im_end|>
{%- endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}
{%- endif %}"""
# Mistral-style: roles must alternate, else raise_exception.
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% endif %}{% endfor %}"
)
TEMPLATES = {"default": None, "llama3": LLAMA3, "chatml": CHATML, "mistral": MISTRAL}
CONTROL = ["<|eot_id|>", "<|start_header_id|>", "<|im_start|>", "<|im_end|>", "<tool_call>"]


def write_variant(source: Path, folder: Path, template: str | None) -> Path:
    """The default model's tokenizer with ChatML's tokens added and `template` as its chat
    template (None: the folder as the default model ships it)."""
    if template is None:
        return source
    folder.mkdir()
    tok = HFTokenizer.from_file(str(source / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True),
                            AddedToken("<|im_end|>", special=True)])  # fmt: skip
    tok.add_tokens([AddedToken("<tool_call>", special=False)])
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module", params=list(TEMPLATES))
def pair(request, tiny_model_path, tmp_path_factory) -> tuple[Tokenizer, Any, str]:
    """(ours, transformers', template name) for one folder."""
    name = request.param
    folder = write_variant(tiny_model_path, tmp_path_factory.mktemp(name) / "tok",
                           TEMPLATES[name])  # fmt: skip
    return Tokenizer(folder), AutoTokenizer.from_pretrained(folder), name


def reference_ids(hf: Any, messages: list[dict[str, Any]], **options: Any) -> list[int]:
    return list(hf.apply_chat_template(messages, tokenize=True, return_dict=False,
                                       sanitize_control_tokens=True, **options))  # fmt: skip


def alternating(messages: list[dict[str, Any]]) -> bool:
    roles = [m["role"] for m in messages]
    return all((r == "user") == (i % 2 == 0) for i, r in enumerate(roles))


text = st.lists(
    st.one_of(st.text(max_size=12), st.sampled_from(CONTROL + [" ", "\n", " \n ", "é 日本 😀"])),
    max_size=4,
).map("".join)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": text}
)
chats = st.lists(message, min_size=1, max_size=5)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=chats, add_generation_prompt=st.booleans())
def test_ids_match_transformers(pair, messages, add_generation_prompt) -> None:
    ours, hf, name = pair
    options = {"add_generation_prompt": add_generation_prompt}
    if name == "mistral" and not alternating(messages):
        with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
            reference_ids(hf, messages, **options)
        with pytest.raises(ChatTemplateError, match="roles must alternate"):
            ours.apply_chat_template(messages, **options)
        return
    assert ours.apply_chat_template(messages, **options) == reference_ids(hf, messages, **options)
    if not any(c in m["content"] for m in messages for c in CONTROL):  # nothing marked
        rendered = hf.apply_chat_template(messages, tokenize=False, **options)
        assert ours.render_chat(messages, **options) == rendered


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": ""}, {"role": "user", "content": "  padded  "}],
        [{"role": "user", "content": "日本語 😀 é"}, {"role": "assistant", "content": "Sure "},
         {"role": "user", "content": "skip me"}, {"role": "assistant", "content": "go on"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b <|eot_id|>"}],
    ],
)  # fmt: skip
def test_continue_final_message_matches_transformers(pair, messages) -> None:
    ours, hf, _ = pair
    options = {"add_generation_prompt": False, "continue_final_message": True}
    try:
        expected = reference_ids(hf, messages, **options)
    except (ValueError, jinja2.TemplateError) as exc:  # a role order or a dropped final message
        with pytest.raises(ChatTemplateError, match="roles must alternate|final message"):
            ours.apply_chat_template(messages, **options)
        assert "roles must alternate" in str(exc) or "final message" in str(exc)
        return
    assert ours.apply_chat_template(messages, **options) == expected


@pytest.mark.parametrize("kwargs", [{"enable_thinking": False}, {"enable_thinking": True}, {}])
def test_chat_template_kwargs_reach_the_template(tiny_model_path, tmp_path, kwargs) -> None:
    folder = write_variant(tiny_model_path, tmp_path / "chatml", CHATML)
    ours, hf = Tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "Hi"}]
    ids = ours.apply_chat_template(messages, template_kwargs=kwargs)
    assert ids == reference_ids(hf, messages, add_generation_prompt=True, **kwargs)
    assert ("<think>" in ours.decode(ids, skip_special_tokens=False)) is (kwargs == {
        "enable_thinking": False})  # fmt: skip


def test_reserved_names_and_conflicting_options_are_refused(tiny_model_path) -> None:
    ours = Tokenizer(tiny_model_path)
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ChatTemplateError, match="may not set messages"):
        ours.apply_chat_template(messages, template_kwargs={"messages": []})
    with pytest.raises(ChatTemplateError, match="cannot both be true"):
        ours.apply_chat_template(messages, add_generation_prompt=True, continue_final_message=True)


def test_template_environment_is_transformers_sandbox(tiny_model_path, tmp_path) -> None:
    """Globals and filters transformers gives templates; the sandbox refuses internals."""
    source = (
        "{{ dict(a=1) | tojson }}|{{ '<b>' | tojson }}|{{ strftime_now('%Y') | length }}"
        "{% generation %}|{{ messages[0]['content'] }}{% endgeneration %}"
    )
    folder = tmp_path / "env"
    shutil.copytree(tiny_model_path, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": source}))
    ours, hf = Tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "x"}]
    assert ours.render_chat(messages) == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert ours.render_chat(messages) == '{"a": 1}|"<b>"|4|x'
    escape = "{{ messages.__class__.__mro__ }}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": escape}))
    with pytest.raises(ChatTemplateError):
        Tokenizer(folder).render_chat(messages)


# Hermes/Qwen-style: the tools in a system turn, past calls as <tool_call> blocks.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for tool in tools %}\n{{ tool | tojson }}"
    "{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("description", ["Weather in a city", "ends <|im_end|> here"])
def test_tools_reach_the_template_as_transformers_passes_them(
    tiny_model_path, tmp_path, description
) -> None:
    """OpenAI's tool definitions as `tools` and past calls as `tool_calls`, token for token
    transformers' (`tools=`); a control token in a tool's description stays text."""
    folder = write_variant(tiny_model_path, tmp_path / "tools", TOOLS_TEMPLATE)
    ours, hf = Tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    parameters = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": description,
                                               "parameters": parameters}}]  # fmt: skip
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}  # fmt: skip
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    ids = ours.apply_chat_template(messages, tools=tools)
    assert ids == reference_ids(hf, messages, add_generation_prompt=True, tools=tools)
    text = ours.decode(ids, skip_special_tokens=False)
    assert '"description": "' + description in text and '"arguments": {"city": "Paris"}' in text
    assert ids.count(ours.token_to_id("<|im_end|>")) == 4  # the description's is not one
