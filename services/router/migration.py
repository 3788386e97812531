"""Token-replay migration: what the router keeps to re-run a request whose engines died.

A request's state is its token ids (Lamina §5, Splitwise §IV): any prompt engine can rebuild its
KV by prefilling prompt + the tokens already streamed, and any token engine can go on from there.
So the router keeps, per request, the prompt, the sampling parameters and every token it has
delivered. When the request's prompt engine, token engine or a shard of its group is lost, the
router sends the request again as a `GenerateRequest` with `output_token_ids` = what was delivered,
under a new wire id (`<req_id>~<n>`) so that late messages of the dead attempt are told apart.
Engines count `output_token_ids` as output (max_tokens, min_tokens, stop rules) and number the
next token after them, so the client's stream continues with no token repeated or missing, and a
seeded request samples its next token from the same generator position (`common.sampling`).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.protocol import SamplingSpec

WIRE_ID_SEP = "~"


@dataclass
class Ledger:
    """One request's replayable state."""

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    attempt: int = 0  # 0: the first run; n: the n-th migration

    @property
    def wire_id(self) -> str:
        """The id engines know this attempt by."""
        return self.req_id if self.attempt == 0 else f"{self.req_id}{WIRE_ID_SEP}{self.attempt}"


@dataclass(frozen=True)
class Replay:
    """What to send for a migration: the new wire id, the prompt, and the tokens already out."""

    wire_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling: SamplingSpec


class MigrationBook:
    """Ledgers of the requests in flight; a bounded number of migrations each."""

    def __init__(self, max_migrations: int = 3) -> None:
        if max_migrations < 0:
            raise ValueError("max_migrations must be >= 0")
        self.max_migrations = max_migrations
        self.ledgers: dict[str, Ledger] = {}
        self._by_wire_id: dict[str, str] = {}

    def open(self, req_id: str, prompt_token_ids: list[int], sampling: SamplingSpec) -> str:
        """Start keeping a request; returns the wire id of its first attempt."""
        ledger = Ledger(req_id, list(prompt_token_ids), sampling)
        self.ledgers[req_id] = ledger
        self._by_wire_id[ledger.wire_id] = req_id
        return ledger.wire_id

    def owner(self, wire_id: str) -> Ledger | None:
        """The ledger whose *current* attempt has this wire id (None: unknown or superseded)."""
        req_id = self._by_wire_id.get(wire_id)
        ledger = None if req_id is None else self.ledgers.get(req_id)
        return ledger if ledger is not None and ledger.wire_id == wire_id else None

    def migrate(self, req_id: str, output_token_ids: list[int]) -> Replay | None:
        """The next attempt of a request whose engines have produced `output_token_ids` so far
        (every token the router took in, streamed or held back); None once it has used its
        migrations."""
        ledger = self.ledgers[req_id]
        if ledger.attempt >= self.max_migrations:
            return None
        self._by_wire_id.pop(ledger.wire_id, None)
        ledger.attempt += 1
        self._by_wire_id[ledger.wire_id] = req_id
        return Replay(
            ledger.wire_id, ledger.prompt_token_ids, list(output_token_ids), ledger.sampling
        )

    def close(self, req_id: str) -> None:
        ledger = self.ledgers.pop(req_id, None)
        if ledger is not None:
            self._by_wire_id.pop(ledger.wire_id, None)
