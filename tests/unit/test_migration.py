"""The router's migration bookkeeping (`services/router/migration.py`): which tokens were
delivered, what a re-run prefills, which attempt a late message belongs to, and the bound; and
how long a stream may go silent while its request is re-run."""

from __future__ import annotations

import openai
import pytest

from common.mesh_options import MeshOptions
from common.protocol import SamplingSpec
from services.router.mesh_client import MIGRATION_BACKOFF_MAX_S, MIGRATION_WAIT_S
from services.router.migration import MigrationBook

SAMPLING = SamplingSpec(max_tokens=50, temperature=0.0)


def test_a_replay_prefills_the_prompt_and_every_delivered_token() -> None:
    book = MigrationBook(max_migrations=2)
    assert book.open("r1", [5, 6, 7], SAMPLING) == "r1"
    replay = book.migrate("r1", [10, 11, 12])
    assert replay is not None
    assert replay.wire_id == "r1~1"
    assert (replay.prompt_token_ids, replay.output_token_ids) == ([5, 6, 7], [10, 11, 12])
    assert replay.sampling == SAMPLING  # max_tokens counts the delivered ones: unchanged
    second = book.migrate("r1", [10, 11, 12, 13])
    assert second is not None and second.output_token_ids == [10, 11, 12, 13]


def test_late_messages_of_a_dead_attempt_have_no_owner() -> None:
    book = MigrationBook()
    book.open("r1", [1], SAMPLING)
    book.migrate("r1", [])
    assert book.owner("r1") is None  # the first attempt's engines may still send: ignored
    ledger = book.owner("r1~1")
    assert ledger is not None and ledger.req_id == "r1"
    book.close("r1")
    assert book.owner("r1~1") is None and not book.ledgers


def test_migrations_are_bounded() -> None:
    book = MigrationBook(max_migrations=1)
    book.open("r1", [1], SAMPLING)
    assert book.migrate("r1", [2]) is not None
    assert book.migrate("r1", [2, 3]) is None
    never = MigrationBook(max_migrations=0)
    never.open("r2", [1], SAMPLING)
    assert never.migrate("r2", []) is None
    with pytest.raises(ValueError):
        MigrationBook(max_migrations=-1)


def test_a_replay_does_not_alias_the_callers_tokens() -> None:
    book = MigrationBook()
    book.open("r1", [1], SAMPLING)
    output = [2]
    replay = book.migrate("r1", output)
    output.append(3)
    assert replay is not None and replay.output_token_ids == [2]


def test_a_stream_silent_until_its_re_run_is_placed_outlasts_the_official_clients_timeout() -> None:
    """Nothing is sent on a stream from its last token until its re-run's first: at most the
    progress deadline, the longest backoff and the wait for room or engines (then it ends
    in-band). The official client's read timeout must not end it first."""
    longest = MeshOptions().progress_timeout_s + MIGRATION_BACKOFF_MAX_S + MIGRATION_WAIT_S
    assert openai.DEFAULT_TIMEOUT.read is not None and openai.DEFAULT_TIMEOUT.read > longest
