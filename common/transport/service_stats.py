"""Asking services what they hold: a `StatsRequest` to each control endpoint, `EngineStats` back.

Every engine and shard binds a ROUTER control socket (`WorkerReady.control_endpoint`) that answers
a `StatsRequest` with its `EngineStats`. The launcher (`LocalMesh.stats`, tests proving no leaks)
and the router (`GET /stats`) both ask through `request_stats`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import structlog
import zmq

from common.protocol import EngineStats, ServiceReply, StatsRequest
from common.transport.zmq_auth import CurveKeys
from common.transport.zmq_sockets import TypedSocket, connect

log = structlog.get_logger(__name__)


def request_stats(
    endpoints: Sequence[str], timeout_s: float, *, auth: CurveKeys | None
) -> dict[str, EngineStats]:
    """Each control endpoint's `EngineStats`, keyed by endpoint.

    Every endpoint is asked at once (a DEALER each), so the whole call takes at most `timeout_s`
    seconds however many there are. An endpoint that does not answer in time, or answers with
    something other than `EngineStats`, is missing from the result and logged; callers decide
    whether that is an error.
    """
    ctx: zmq.Context = zmq.Context.instance()
    deadline = time.monotonic() + timeout_s
    asked: dict[str, TypedSocket[ServiceReply]] = {}
    replies: dict[str, EngineStats] = {}
    try:
        for endpoint in dict.fromkeys(endpoints):  # each once, in order
            asked[endpoint] = _ask(ctx, endpoint, auth)
        for endpoint, sock in asked.items():
            item = sock.recv(max(0.0, deadline - time.monotonic()))
            if item is not None and isinstance(item[1], EngineStats):
                replies[endpoint] = item[1]
            else:
                log.warning("no stats from a service", endpoint=endpoint, reply=repr(item))
    finally:
        for sock in asked.values():
            sock.close()
    return replies


def _ask(ctx: zmq.Context, endpoint: str, auth: CurveKeys | None) -> TypedSocket[ServiceReply]:
    """A DEALER connected to `endpoint` that has sent it a `StatsRequest`."""
    sock = connect(ctx, zmq.DEALER, endpoint, auth=auth)
    request: TypedSocket[StatsRequest] = TypedSocket(sock, StatsRequest)
    request.send(StatsRequest())
    return TypedSocket(sock, ServiceReply)
