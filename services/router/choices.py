"""`n` and `best_of`: one API request as several engine requests, one per choice.

Each choice is an engine request of its own (its own wire id, admitted and counted like any
other, so a request for n choices takes n of the admission bounds), with a seed derived from the
request's when it has one: the choices differ, and the same request gives the same choices again.
`merge` interleaves the choices' streams as their outputs come; closing it (a client that goes
away) closes every choice's stream, which aborts its engine request. `best` keeps the n choices
with the highest cumulative logprob (best_of).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any

from common.engine.request import RequestOutput
from common.protocol import TokenLogprobs
from common.sampling_params import MAX_SEED, SamplingParams

Outputs = AsyncGenerator[RequestOutput, None]
_SEED_STRIDE = 0x9E3779B97F4A7C15  # odd: distinct choices get distinct seeds


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s parameters: the request's, its seed moved on for every choice but the
    first (so n=1 samples exactly what it did before n existed)."""
    if params.seed is None or index == 0:
        return params
    return replace(params, seed=(params.seed + index * _SEED_STRIDE) % MAX_SEED)


async def start_all(start: Callable[[int], Awaitable[Outputs]], count: int) -> list[Outputs]:
    """Start `count` choices in order; if one is refused (429, 400), close those started."""
    started: list[Outputs] = []
    try:
        for index in range(count):
            started.append(await start(index))
    except BaseException:
        for outputs in started:
            await outputs.aclose()
        raise
    return started


@dataclass
class Collected:
    """One choice's whole output."""

    text: str
    last: RequestOutput
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] | None = None

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp.logprob for lp in self.logprobs)  # best_of ranks candidates by it


async def collect(outputs: Outputs) -> Collected:
    parts: list[str] = []
    collected: Collected | None = None
    async with aclosing(outputs):
        async for out in outputs:
            parts.append(out.new_text)
            if collected is None:
                collected = Collected("", out, prompt_logprobs=out.prompt_logprobs)
            collected.last = out
            collected.token_ids += out.new_token_ids
            collected.logprobs += out.logprobs
    assert collected is not None, "a started request has at least one output"
    collected.text = "".join(parts)
    return collected


async def collect_all(choices: list[Outputs]) -> list[Collected]:
    """Every choice's output, in choice order; one failing ends (and aborts) the others."""
    tasks = [asyncio.ensure_future(collect(outputs)) for outputs in choices]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        await _end_all(tasks, choices)


def best(collected: list[Collected], n: int) -> list[Collected]:
    """The n with the highest cumulative logprob, best first (vLLM's best_of order)."""
    return sorted(collected, key=lambda c: c.cumulative_logprob, reverse=True)[:n]


async def merge(choices: list[Outputs]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """(choice index, output) as each choice's outputs arrive; a failing choice raises here."""
    if len(choices) == 1:  # n = 1, nearly every request: its outputs as they come, no task and
        # no queue hop per output (each a wake-up of the loop, per streamed chunk)
        async with aclosing(choices[0]) as outputs:
            async for out in outputs:
                yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

    async def pump(index: int, outputs: Outputs) -> None:
        try:
            async with aclosing(outputs):
                async for out in outputs:
                    queue.put_nowait((index, out))
            queue.put_nowait((index, None))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait((index, exc))

    tasks = [asyncio.ensure_future(pump(i, outputs)) for i, outputs in enumerate(choices)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:  # a client gone, or a choice failed: abort the others
        await _end_all(tasks, choices)


async def _end_all(tasks: Sequence[asyncio.Future[Any]], choices: list[Outputs]) -> None:
    """Cancel the tasks reading the choices and close every choice's stream (which aborts its
    request if unfinished); a task cancelled before it ran never opened its stream."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for outputs in choices:
        await outputs.aclose()
