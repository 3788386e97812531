"""`DroppedOutputs`: an engine telling a router which requests' outputs it could not queue.

An engine never blocks on a router (`PushPool`): when a router's inbox is full (the router
stopped reading: SIGSTOPped, or its loop held) the engine gives those requests up and frees
their KV. The router must hear of it, or it waits for tokens that never come until its progress
deadline. So the request ids are kept here per router and sent as one `OutputsDropped` on a
PUSH socket of their own: the router's PULL socket takes turns between its connections, so the
notice is not queued behind the token batches that filled the other one. A notice that cannot be
queued either stays here and goes, with whatever was dropped since, on the next `flush`.

Bounds: one socket per router with a short queue (`NOTICE_HWM`); at most
`MAX_PENDING_PER_ROUTER` ids kept per router (beyond that the oldest are forgotten, logged: the
router's progress deadline still ends them). A router that is lost (`forget`) takes its
ids and its socket with it: its requests ended here already.
"""

from __future__ import annotations

import structlog
import zmq

from common.protocol import OutputsDropped
from common.transport.zmq_auth import CurveKeys
from common.transport.zmq_sockets import PushPool

log = structlog.get_logger(__name__)

NOTICE_HWM = 16  # notices queued per router; more would say nothing new
MAX_PENDING_PER_ROUTER = 100_000


class DroppedOutputs:
    """Requests given up for want of room at their router, until that router is told."""

    def __init__(self, ctx: zmq.Context, auth: CurveKeys | None, engine_id: str) -> None:
        self._push: PushPool[OutputsDropped] = PushPool(ctx, OutputsDropped, auth=auth,
                                                        hwm=NOTICE_HWM)  # fmt: skip
        self._pending: dict[str, dict[str, None]] = {}  # router -> req ids, in order
        self._error = f"engine {engine_id} could not queue its outputs for this router"

    def add(self, router: str, req_ids: list[str]) -> None:
        pending = self._pending.setdefault(router, {})
        pending.update(dict.fromkeys(req_ids))
        if len(pending) > MAX_PENDING_PER_ROUTER:
            excess = list(pending)[: len(pending) - MAX_PENDING_PER_ROUTER]
            log.warning("too many dropped outputs untold; forgetting the oldest",
                        router=router, num_forgotten=len(excess))  # fmt: skip
            for req_id in excess:
                del pending[req_id]

    def flush(self) -> None:
        """Queue a notice for every router with untold ids; a router still not taking one
        keeps them for the next call."""
        for router, pending in list(self._pending.items()):
            try:
                self._push.get(router).send(OutputsDropped(list(pending), self._error))
            except zmq.Again:
                continue
            del self._pending[router]
            log.warning("told a router of the requests given up for it", router=router,
                        req_ids=list(pending)[:8], num_requests=len(pending))  # fmt: skip

    def forget(self, router: str) -> None:
        """`router` is gone: nothing to tell it."""
        self._pending.pop(router, None)
        self._push.drop(router)

    def __bool__(self) -> bool:
        return bool(self._pending)

    def close(self) -> None:
        self._push.close()


__all__ = ["DroppedOutputs"]
