"""A request's prompt as token ids, without holding the router's event loop (which serves every
stream) for longer than a short prompt takes.

Three steps, cheapest first:

- `PromptBound` refuses a prompt that certainly cannot fit the context before any tokenizing:
  its UTF-8 bytes over the most bytes one token stands for, and a chat's message count, are
  lower bounds on its token count.
- A short prompt is tokenized on the loop, where that costs less than handing it to a worker.
- A long one goes to a pool of its own: plain text to threads, through the tokenizer's call that
  releases the GIL; a chat to worker processes (the Jinja template and the control-token marking
  are Python and hold the GIL), each with the tokenizer built once from the model folder.

`BoundedPool` holds a bounded amount of work (running and queued): past it a request is a 429
with Retry-After instead of a wait behind other requests' prompts. The router gives each kind
of off-loop work (tokenizing, chat templates, grammar compiles, `/stats`) a pool of its own, so
no kind waits behind another.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, TypeVar

from common.chat_template import ChatTemplateError
from common.tokenizer import Tokenizer
from services.router.api_errors import RETRY_AFTER_S, APIError
from services.router.http_edge import check_unicode

T = TypeVar("T")

# A prompt this long (characters), or a chat body this large (bytes), is tokenized off the
# event loop; a shorter one on it: handing work to a thread or a process (submit, wake, hand the
# result back) costs more than tokenizing a few hundred tokens.
INLINE_PROMPT_LIMIT = 4096
INLINE_CHAT_BYTES = 16 << 10
# chat_template_kwargs deeper than this is a 400: templates read flags and short lists, and the
# walks over the value (control-token marking, Unicode checks) must not run out of stack.
MAX_KWARGS_DEPTH = 32
# Roles whose text a template writes out whole (trimmed at most), checked per template at start:
# assistant turns (templates drop past reasoning) and tool results are not counted.
_TEXT_ROLES = ("system", "developer", "user")


class BoundedPool:
    """An executor, made on first use, that holds at most `capacity` calls (running and
    queued); a call past that is a 429 with Retry-After. A broken process pool (a worker
    killed) fails its calls with a 503 and is replaced on the next call."""

    def __init__(self, name: str, make: Callable[[], Executor], capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a pool holds at least one call, not {capacity}")
        self.name, self.capacity = name, capacity
        self._make = make
        self._executor: Executor | None = None
        self.num_in_flight = 0

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self.num_in_flight >= self.capacity:
            raise APIError(429, f"the router's {self.name} queue is full: retry shortly",
                           retry_after_s=RETRY_AFTER_S)  # fmt: skip
        if self._executor is None:
            self._executor = self._make()
        executor, loop = self._executor, asyncio.get_running_loop()
        try:
            future: Future[T] = executor.submit(fn, *args)
            self.num_in_flight += 1
            # NOTE: counted until the call ends, not until its caller stops waiting: a client
            # that went away leaves its call running, and it still holds a worker.
            future.add_done_callback(lambda _: self._done_from(loop))
            return await asyncio.wrap_future(future)
        except BrokenProcessPool as exc:
            if self._executor is executor:  # not one a later call already made
                executor.shutdown(wait=False)
                self._executor = None
            raise APIError(503, f"the router's {self.name} workers stopped: retry shortly",
                           retry_after_s=RETRY_AFTER_S) from exc  # fmt: skip

    def _done_from(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the worker's side when a call ends: count it done on the caller's loop."""
        try:
            loop.call_soon_threadsafe(self._done)
        except RuntimeError:  # that loop has closed: no caller is left to race with
            self._done()

    def _done(self) -> None:
        self.num_in_flight -= 1

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


@dataclasses.dataclass(frozen=True)
class ChatOptions:
    """How a chat becomes a prompt (`services.router.chat_options.ChatTemplateFields`)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # OpenAI's tool definitions, for the template


def chat_prompt_ids(
    tokenizer: Tokenizer, chat: list[dict[str, Any]], options: ChatOptions
) -> list[int]:
    """The prompt ids of a chat (`{"role", "content"}` dicts, content a string) through the
    model's chat template; text that is not valid Unicode, kwargs nested too deep, or a template
    that refuses the chat is a 400 naming the field."""
    check_unicode("messages", _strings(chat, "messages"))  # past tool calls and ids too
    check_unicode("chat_template_kwargs", _strings(options.template_kwargs))
    check_unicode("tools", _strings(options.tools, "tools"))
    try:
        return tokenizer.apply_chat_template(
            chat, options.add_generation_prompt, options.continue_final_message,
            options.template_kwargs, options.tools,
        )  # fmt: skip
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), exc.param) from exc


def _strings(obj: Any, param: str = "chat_template_kwargs") -> Iterator[str]:
    """Every string in a JSON value, keys included; a 400 naming `param` past
    `MAX_KWARGS_DEPTH` levels. Iterative, so that no nesting can exhaust the stack."""
    stack = [(obj, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            yield value
            continue
        if not isinstance(value, dict | list):
            continue
        if depth >= MAX_KWARGS_DEPTH:
            raise APIError(400, f"{param} nests deeper than {MAX_KWARGS_DEPTH} levels",
                           param)  # fmt: skip
        if isinstance(value, dict):
            yield from (key for key in value if isinstance(key, str))
            stack += [(v, depth + 1) for v in value.values()]
        else:
            stack += [(v, depth + 1) for v in value]


class PromptBound:
    """Lower bounds on a prompt's token count that take no tokenizing: a prompt past the context
    by these is a 400 at once. A tokenizer whose tokens may stand for any length of text (an
    unknown-word token) gives no byte bound; a template that writes nothing for an empty turn
    gives no message bound."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.max_token_bytes = tokenizer.max_token_bytes
        self.text_roles = _rendered_roles(tokenizer)
        self.tokens_per_turn = _tokens_per_turn(tokenizer)

    def check_text(self, text: str, param: str) -> None:
        """A 400 when `text` is not valid Unicode, or its bytes alone exceed the context."""
        check_unicode(param, [text])
        self._check(self._min_tokens(len(text.encode())), param)

    def check_chat(self, chat: list[dict[str, Any]]) -> None:
        """A 400 when the chat's turns or its users' text alone exceed the context."""
        num_turns = sum(m["role"] in ("user", "assistant") for m in chat)
        texts = [m["content"].strip() for m in chat if m["role"] in self.text_roles]
        check_unicode("messages", texts)
        num_bytes = sum(len(text.encode()) for text in texts)
        self._check(max(num_turns * self.tokens_per_turn, self._min_tokens(num_bytes)), "messages")

    def _min_tokens(self, num_bytes: int) -> int:
        if self.max_token_bytes is None:
            return 0
        return -(-num_bytes // self.max_token_bytes)

    def _check(self, min_tokens: int, param: str) -> None:
        if min_tokens >= self.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your {param} holds at least {min_tokens} tokens, which leaves no room for "
                "output. Please reduce the length of the prompt.",
                param,
            )


def _rendered_roles(tokenizer: Tokenizer) -> frozenset[str]:
    """The roles of `_TEXT_ROLES` whose text the template writes out (a marker per role)."""
    roles = set()
    for role in _TEXT_ROLES:
        chat = [{"role": role, "content": f"probe {role} text"}]
        if role != "user":
            chat.append({"role": "user", "content": "hi"})  # templates that want a user turn
        try:
            if f"probe {role} text" in tokenizer.render_chat(chat):
                roles.add(role)
        except ChatTemplateError:
            continue
    return frozenset(roles)


def _tokens_per_turn(tokenizer: Tokenizer) -> int:
    """1 when each empty user and assistant turn adds a token to the prompt, else 0."""
    turns = [{"role": r, "content": ""} for r in ("user", "assistant", "user", "assistant")]
    try:
        lens = [len(tokenizer.apply_chat_template(turns[:n])) for n in (2, 3, 4)]
    except ChatTemplateError:
        return 0
    return int(lens[0] < lens[1] < lens[2])


# NOTE: a chat worker process's tokenizer, built once by the pool's initializer: the one
# module-level state here, and it lives only in the pool's processes.
_worker_tokenizer: Tokenizer | None = None


def _start_worker(model_path: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = Tokenizer(model_path)


def _worker_chat_ids(chat: list[dict[str, Any]], options: ChatOptions) -> list[int]:
    assert _worker_tokenizer is not None, "started without _start_worker"
    return chat_prompt_ids(_worker_tokenizer, chat, options)


class PromptWork:
    """Token ids of completion prompts and chats for one router (module docstring)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        model_path: str | Path,
        max_model_len: int,
        num_chat_processes: int = 1,
        num_text_threads: int = 2,
        queue_depth: int = 4,
    ) -> None:
        """`num_chat_processes`: workers rendering long chats, started on the first one;
        `queue_depth`: calls each pool queues per worker beyond the running ones."""
        self.tokenizer = tokenizer
        self.bound = PromptBound(tokenizer, max_model_len)
        self.text_pool = BoundedPool(
            "tokenizer",
            lambda: ThreadPoolExecutor(num_text_threads, thread_name_prefix="tokenize"),
            num_text_threads * (1 + queue_depth),
        )
        # NOTE: spawned, never forked: the router's process runs threads (sockets, Serve) that a
        # fork would copy mid-flight.
        spawn = multiprocessing.get_context("spawn")
        self.chat_pool = BoundedPool(
            "chat template",
            lambda: ProcessPoolExecutor(num_chat_processes, mp_context=spawn,
                                        initializer=_start_worker,
                                        initargs=(str(model_path),)),
            num_chat_processes * (1 + queue_depth),
        )  # fmt: skip

    async def text_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of a text prompt (`param` "prompt"); a 400 when it cannot fit the context."""
        self.bound.check_text(text, "prompt")
        if len(text) <= INLINE_PROMPT_LIMIT:
            return self.tokenizer.encode(text, add_special_tokens)
        return await self.text_pool.run(self.tokenizer.encode_long, text, add_special_tokens)

    async def chat_ids(
        self, chat: list[dict[str, Any]], options: ChatOptions, body_bytes: int | None
    ) -> list[int]:
        """Ids of a chat; `body_bytes`, the request body's size (None: unknown), decides whether
        it is short enough to render on the loop."""
        self.bound.check_chat(chat)
        if body_bytes is not None and body_bytes <= INLINE_CHAT_BYTES:
            return chat_prompt_ids(self.tokenizer, chat, options)
        return await self.chat_pool.run(_worker_chat_ids, chat, options)

    def shutdown(self) -> None:
        self.text_pool.shutdown()
        self.chat_pool.shutdown()
