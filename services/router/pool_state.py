"""The pools as the engines report them, and the role changes a router asks of them.

Splitwise's pools (§IV-A) are state of the engines (`common/scheduling/role_lease.py`): each load
report says which pool its engine serves in now and which is its home. `ReportedPools` keeps
those, turns the policy's moves into `SetRole` commands, and renews the lease of every lent
engine that still has work of its borrowed kind. Every router replica reads the same reports and
so sees the same pools; two of them asking for the same change converge (it is idempotent).

A home change (`rehome`, the home-role policy's: common/scheduling/home_roles.py) is a `SetRole`
with `home` set; the table assumes it, as any change, until the engine's reports say it.

A change is assumed for `CONFIRM_S` after it was asked (placements meanwhile count on it), then
only the engine's word counts: a command lost on the way is asked for again by the next
placement that needs it. A lent engine is sent home only on the word of a report made after the
one that first said it serves mixed (`releasable`): a report sent before the engine took the
loan, or in the same breath, predates the borrowed work the router placed with it, and judged
drained on it the engine came home before that work began (tests/integration/test_jsq_placement.py
caught this: the borrowed engine never reported mixed at all). Not thread-safe:
`ClusterScheduler` holds its lock around it.
"""

from __future__ import annotations

from collections.abc import Mapping

import structlog

from common.protocol import LoadReport, SetRole
from common.roles import Role
from common.scheduling.cluster import PoolMove, PoolTable
from common.scheduling.role_lease import LENDABLE

log = structlog.get_logger(__name__)

CONFIRM_S = 1.0  # many load reports (50 ms apart): an unconfirmed change has been lost by then
RENEW_FRACTION = 3  # a lease is renewed every third of its length (two renewals may be lost)
# Reports in a row saying mixed before a lent engine's load may send it home: the first one may
# have been made before the work lent for reached it (it came after the `SetRole`).
RELEASE_AFTER_MIXED_REPORTS = 2


class ReportedPools:
    """(home, current) pool per machine id from its reports, and the `SetRole`s to send."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self.reported: dict[int, tuple[Role, Role]] = {}
        self._asked: dict[int, tuple[Role, float]] = {}  # machine -> (role, when asked)
        self._asked_home: dict[int, tuple[Role, float]] = {}  # machine -> (home, when asked)
        self._renewed: dict[int, float] = {}
        self._mixed_reports: dict[int, int] = {}  # machine -> its reports in a row saying mixed
        self.outbox: list[tuple[int, SetRole]] = []  # taken by the router, which sends them

    def on_report(self, machine_id: int, report: LoadReport) -> None:
        if not report.role:  # says nothing of its pool: the registry's (home) role stands
            return
        try:
            home, current = Role(report.home_role or report.role), Role(report.role)
        except ValueError:  # another version's engine, or a broken one: not the router's to die of
            log.warning("load report with an unknown pool ignored", engine_id=report.engine_id,
                        role=report.role, home_role=report.home_role)  # fmt: skip
            return
        self.reported[machine_id] = (home, current)
        in_a_row = self._mixed_reports.get(machine_id, 0) + 1 if report.role == Role.MIXED else 0
        self._mixed_reports[machine_id] = in_a_row

    def releasable(self, machine_id: int) -> bool:
        """Whether this lent engine's reported load may send it home (see the module's doc)."""
        return self._mixed_reports.get(machine_id, 0) >= RELEASE_AFTER_MIXED_REPORTS

    def forget_all_but(self, machine_ids: Mapping[int, object]) -> None:
        tables = (self.reported, self._asked, self._asked_home, self._renewed, self._mixed_reports)
        for table in tables:
            for gone in [m for m in table if m not in machine_ids]:
                del table[gone]

    def sync(self, pools: PoolTable, now: float) -> None:
        """Set the policy's table to the engines' word (or to a change asked just now)."""
        views = {}
        for machine_id, (home, current) in self.reported.items():
            home = _unconfirmed(self._asked_home.get(machine_id), home, now)
            current = _unconfirmed(self._asked.get(machine_id), current, now)
            views[machine_id] = (home, current)
        pools.sync(views, now)

    def ask(self, moves: list[PoolMove] | tuple[PoolMove, ...], now: float) -> None:
        """Turn the policy's moves into commands. A re-purposing (a new home) is not asked for:
        an engine's home is its deployment's (the next sync undoes it in the table)."""
        for move in moves:
            if not move.repurposed:
                self._send(move.machine_id, move.to_pool, now)

    def rehome(self, machine_id: int, home: Role, now: float) -> None:
        """Ask the engine to move its home to `home` (and serve there, any loan ended)."""
        self.outbox.append((machine_id, SetRole(home, 0.0, home=home)))
        self._asked[machine_id] = self._asked_home[machine_id] = (home, now)
        self._renewed.pop(machine_id, None)

    def renew(self, pools: PoolTable, now: float) -> None:
        """Renew the lease of every lent engine the policy keeps in the mixed pool."""
        for machine_id in pools.members(Role.MIXED):
            lent = pools.home[machine_id] in LENDABLE
            due = now - self._renewed.get(machine_id, float("-inf")) >= (
                self.lease_s / RENEW_FRACTION
            )
            if lent and due:
                self._send(machine_id, Role.MIXED, now)

    def _send(self, machine_id: int, role: Role, now: float) -> None:
        lease_s = self.lease_s if role == Role.MIXED else 0.0
        self.outbox.append((machine_id, SetRole(role, lease_s)))
        self._asked[machine_id] = (role, now)
        if role == Role.MIXED:
            self._renewed[machine_id] = now
        else:
            self._renewed.pop(machine_id, None)


def _unconfirmed(asked: tuple[Role, float] | None, reported: Role, now: float) -> Role:
    """What a machine's reported `reported` pool counts as: the one just asked for, within
    `CONFIRM_S` of asking, else its word."""
    if asked is not None and asked[0] != reported and now - asked[1] < CONFIRM_S:
        return asked[0]
    return reported
