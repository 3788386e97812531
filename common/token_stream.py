"""Restoring each request's token order at the receiver (router or test client).

A request's first token travels prompt engine -> router and the rest token engine -> router, on
different ZeroMQ connections, so under load the second token can overtake the first.
"""

from __future__ import annotations

from collections import deque

from common.protocol import TokenOutput


class TokenStreamOrderer:
    """Feed `TokenOutput`s in arrival order; take them out in each request's token order.
    Errors pass straight through (they end the request whatever its position).

    `expected_only`: hold tokens only of requests announced with `expect` (a router, which knows
    what it sent): tokens of anything else (a request already forgotten, a forgery) are dropped
    instead of being held forever."""

    def __init__(self, expected_only: bool = False) -> None:
        self.expected_only = expected_only
        self._next: dict[str, int] = {}
        self._held: dict[str, dict[int, TokenOutput]] = {}
        self.ready: deque[TokenOutput] = deque()

    def expect(self, req_id: str, index: int) -> None:
        """The stream of `req_id` starts at output position `index` (a migrated request goes on
        from the tokens it already streamed)."""
        self._next[req_id] = index

    def push(self, out: TokenOutput) -> None:
        if out.error:
            self.forget(out.req_id)
            self.ready.append(out)
            return
        if self.expected_only and out.req_id not in self._next:
            return
        held = self._held.setdefault(out.req_id, {})
        held[out.index] = out
        expected = self._next.get(out.req_id, 0)
        while expected in held:
            msg = held.pop(expected)
            self.ready.append(msg)
            expected += len(msg.token_ids)
            if msg.finish_reason:
                self.forget(out.req_id)
                return
        self._next[out.req_id] = expected

    def forget(self, req_id: str) -> None:
        self._next.pop(req_id, None)
        self._held.pop(req_id, None)
