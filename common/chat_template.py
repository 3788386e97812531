"""Chat templates rendered exactly as transformers' `apply_chat_template` renders them.

A checkpoint's `chat_template` is Jinja written against transformers' environment, whose
whitespace rules decide the prompt's tokens: `trim_blocks` and `lstrip_blocks`, the `loopcontrols`
extension, a `tojson` that does not escape HTML, and the globals `raise_exception`,
`strftime_now`, `dict` and `namespace`. This module rebuilds that environment (transformers
5.x, `utils/chat_template_utils.py`) without importing transformers, which the server does not
depend on; `tests/unit/test_chat_template.py` checks it token for token against transformers.

User text is marked, as transformers' `sanitize_control_tokens=True` does: each control-token
string inside a message (say "<|eot_id|>") is wrapped in private-use markers, so the tokenizer
encodes it as plain text and a user cannot end their turn and open a system one (role injection).
transformers' default, `sanitize_control_tokens=False`, would encode such a string as the control
token; we never do.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Private-use code points around a control token that came from user text (transformers' own).
MARK_START, MARK_END = "\U000f0000", "\U000f0001"
# transformers appends this to the final message to find where it ends in the rendered chat.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# The names `render` passes itself: chat_template_kwargs may not replace them.
RESERVED_NAMES = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message"}
)
# transformers' named special tokens; any other `*_token` string in the config is one too.
SPECIAL_TOKEN_NAMES = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)  # fmt: skip


class ChatTemplateError(ValueError):
    """The template refused the chat (its `raise_exception`, a failing filter) or the request's
    template options do not fit it: the client's 400, naming the request field `param`."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers uses the block to
    find assistant tokens; templates that mark them must still parse)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


class _TemplateDict:
    """`dict(...)` without the attribute access that could reach the class (transformers')."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names, so a template cannot reach interpreter
    internals through it (transformers')."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (Jinja's signature trick)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes, got {name!r}"
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None,
    separators: tuple[str, str] | None = None, sort_keys: bool = False,
) -> str:  # fmt: skip
    # Jinja's own tojson escapes HTML characters; chat templates want the JSON as written.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """`source` compiled in transformers' sandboxed chat-template environment."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def literal_text(source: str) -> str:
    """The template's literal strings joined by NULs: an added token found here is one the
    template writes itself, a control token (transformers' `_get_template_literal_text`)."""
    ast = compile_template(source).environment.parse(source)
    literals = {node.data for node in ast.find_all(jinja2.nodes.TemplateData)}
    literals |= {n.value for n in ast.find_all(jinja2.nodes.Const) if isinstance(n.value, str)}
    return "\0".join(literals)


def special_tokens_map(config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens of a `tokenizer_config.json` (`bos_token`, ..., any `*_token`,
    `extra_special_tokens` given as a dict), as the template sees them."""
    named: dict[str, Any] = {k: v for k, v in config.items() if k.endswith("_token")}
    extra = config.get("extra_special_tokens")
    if isinstance(extra, Mapping):
        named |= extra
    texts = {name: _token_text(value) for name, value in named.items()}
    return {name: text for name, text in texts.items() if text is not None}


def _token_text(token: Any) -> str | None:
    """A token as the config writes it: a string or an AddedToken dict."""
    if isinstance(token, Mapping):
        token = token.get("content")
    return token if isinstance(token, str) else None


def control_pattern(tokens: Iterable[str]) -> re.Pattern[str]:
    """A regex matching any of `tokens`, longest first (a token beats the tokens it contains)."""
    longest_first = sorted(set(tokens), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, longest_first)) or "(?!)")  # (?!) never matches


def marker_pattern(tokens: Iterable[str]) -> re.Pattern[str]:
    """Splits a rendered chat at marked tokens (captured) and at lone markers (None)."""
    inner = control_pattern(tokens).pattern
    return re.compile(f"{MARK_START}({inner}){MARK_END}|[{MARK_START}{MARK_END}]")


def mark_control_tokens(obj: Any, pattern: re.Pattern[str]) -> Any:
    """Every string in `obj` (dict values, list items) with its control tokens wrapped in
    markers; markers a user sent are dropped first, so they cannot forge a marked token."""
    if isinstance(obj, str):
        obj = obj.replace(MARK_START, "").replace(MARK_END, "")
        return pattern.sub(f"{MARK_START}\\g<0>{MARK_END}", obj)
    if isinstance(obj, Mapping):
        return {key: mark_control_tokens(value, pattern) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        return [mark_control_tokens(value, pattern) for value in obj]
    return obj


def render(
    source: str,
    messages: list[dict[str, Any]],
    special_tokens: Mapping[str, str],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The chat as text, as transformers renders it (`documents` is None; `tools` OpenAI's
    tool definitions or None).

    `continue_final_message` leaves the last message open for the model to continue (no
    end-of-turn after it), as transformers and vLLM do. Raises `ChatTemplateError`."""
    kwargs = dict(template_kwargs or {})
    if reserved := RESERVED_NAMES & kwargs.keys():
        names = ", ".join(sorted(reserved))
        raise ChatTemplateError(f"chat_template_kwargs may not set {names}", "chat_template_kwargs")
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError(
            "continue_final_message and add_generation_prompt cannot both be true",
            "continue_final_message",
        )
    # Keys whose value is None are dropped: templates handle a missing key, not a None one.
    chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
    final = _tag_final_message(chat, source) if continue_final_message else None
    try:
        text = compile_template(source).render(
            messages=chat, tools=tools, documents=None,
            add_generation_prompt=add_generation_prompt, **(dict(special_tokens) | kwargs),
        )  # fmt: skip
    except jinja2.exceptions.TemplateError as exc:  # raise_exception, sandbox refusals, syntax
        raise ChatTemplateError(exc.message or type(exc).__name__) from exc
    except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
        raise ChatTemplateError(f"the chat template failed on these messages: {exc}") from exc
    return text if final is None else _cut_at_tag(text, final)


def _tag_final_message(chat: list[dict[str, Any]], source: str) -> str:
    """Append the continue tag to the last message's content; its content before the tag."""
    if not chat or not isinstance(final := chat[-1].get("content"), str):
        raise ChatTemplateError(
            "continue_final_message needs a final message with text content", "messages"
        )
    if "content" not in source:
        raise ChatTemplateError(
            "continue_final_message: the chat template reads no content", "continue_final_message"
        )
    chat[-1] = chat[-1] | {"content": final + _CONTINUE_TAG}
    return final


def _cut_at_tag(text: str, final: str) -> str:
    """The rendered chat up to the end of the final message (transformers' rule)."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ChatTemplateError(
            "continue_final_message: the chat template drops part of the final message"
        )
    at = text.rindex(tag)
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing space
