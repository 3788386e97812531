"""`recheck`, the one check both registry keepers (shard group, model peers) run: against a
fabricated registry and clock, what it reports lost, when, and when it claims again."""

from __future__ import annotations

from common.roles import Role
from services.mesh.absence import ABSENT_CONFIRM_S, Absences, recheck
from services.mesh.registry import ServiceEntry


def ready(service_id: str) -> ServiceEntry:
    return ServiceEntry(role=Role.SHARD, service_id=service_id, state="ready")


class FakeRegistry:
    def __init__(self, *entries: ServiceEntry) -> None:
        self.entries = list(entries)

    def live(self) -> list[ServiceEntry]:
        return list(self.entries)


class Claims:
    """`claim()` for recheck: hands out `entries`, and counts the calls."""

    def __init__(self, *entries: ServiceEntry) -> None:
        self.entries = entries
        self.num_calls = 0

    def __call__(self) -> tuple[ServiceEntry, ...]:
        self.num_calls += 1
        return self.entries


def test_a_keeper_that_wants_nothing_or_holds_all_claims_nothing() -> None:
    a, b = ready("a"), ready("b")
    registry, claims = FakeRegistry(a, b), Claims(a, b)
    assert recheck(Absences(), registry, (), 0, claims, lambda: 0.0) is None
    assert recheck(Absences(), registry, (a, b), 2, claims, lambda: 0.0) is None
    assert claims.num_calls == 0


def test_a_missing_entry_is_lost_only_after_the_confirm_time() -> None:
    a, b, c = ready("a"), ready("b"), ready("c")
    registry, absences, claims = FakeRegistry(a), Absences(), Claims(a, c)
    now = [10.0]
    found = recheck(absences, registry, (a, b), 2, claims, lambda: now[0])
    assert found is None and claims.num_calls == 0  # b may be a restarted registry's gap
    now[0] += ABSENT_CONFIRM_S
    found = recheck(absences, registry, (a, b), 2, claims, lambda: now[0])
    assert found == (("b",), (a, c))


def test_a_short_keeper_reports_only_a_new_claim() -> None:
    a, b = ready("a"), ready("b")
    registry = FakeRegistry(a, b)
    same = recheck(Absences(), registry, (a,), 2, Claims(a), lambda: 0.0)
    assert same is None
    grown = recheck(Absences(), registry, (a,), 2, Claims(a, b), lambda: 0.0)
    assert grown == ((), (a, b))
