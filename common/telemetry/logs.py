"""structlog setup: JSON lines in production, readable console in a terminal, and the request id
and trace id on every log line of a request.

`PHASEMESH_LOG_FORMAT` is `json` or `console`; unset, it is `console` on a TTY and `json`
otherwise. `PHASEMESH_LOG_LEVEL` (default `info`) filters. Logs go to stderr, so a CLI's stdout
stays its own (bench scripts end stdout with one JSON line).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

from common.config import env
from common.telemetry.context import current_trace_ids, trace_id_of

LOG_FORMATS = ("json", "console")


def configure_logging(
    log_format: str | None = None, level: str | None = None, stream: TextIO | None = None
) -> None:
    """Configure structlog for this process; safe to call again (the last call wins).

    Arguments override `PHASEMESH_LOG_FORMAT` and `PHASEMESH_LOG_LEVEL`; `stream` defaults to
    stderr.
    """
    stream = stream or sys.stderr
    chosen = (log_format or env("LOG_FORMAT") or _default_format(stream)).lower()
    if chosen not in LOG_FORMATS:
        raise ValueError(f"PHASEMESH_LOG_FORMAT must be json or console, got {chosen!r}")
    level_name = (level or env("LOG_LEVEL") or "info").upper()
    if level_name not in logging.getLevelNamesMapping():
        raise ValueError(f"PHASEMESH_LOG_LEVEL must be a logging level name, got {level_name!r}")
    renderer: Processor = (
        structlog.processors.JSONRenderer()
        if chosen == "json"
        else structlog.dev.ConsoleRenderer(colors=stream.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_trace_ids,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level_name)),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )


def _default_format(stream: TextIO) -> str:
    return "console" if stream.isatty() else "json"


def add_trace_ids(logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
    """structlog processor: the current span's trace and span ids, unless already bound."""
    trace_id, span_id = current_trace_ids()
    if trace_id:
        event_dict.setdefault("trace_id", trace_id)
        event_dict.setdefault("span_id", span_id)
    return event_dict


@contextmanager
def bind_request(req_id: str, *, traceparent: str = "", **extra: Any) -> Iterator[None]:
    """Put `req_id` and its trace id on every log line written inside the block.

    The trace id is the current span's; a service with no span open yet (it just decoded a
    message) passes the message's `traceparent` string instead. Bound through contextvars, so
    it follows asyncio tasks but not other threads.
    """
    trace_id, _ = current_trace_ids()
    trace_id = trace_id or trace_id_of(traceparent)
    fields: dict[str, Any] = {"req_id": req_id, **extra}
    if trace_id:
        fields["trace_id"] = trace_id
    with structlog.contextvars.bound_contextvars(**fields):
        yield
