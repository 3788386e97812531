"""An engine's pool membership as state it owns: its home role, and a lease on the mixed pool.

Splitwise §IV-A lends a prompt or token machine to the mixed pool while prompts (or decodes) pile
up. In PhaseMesh the decision is a router's, but the state is the engine's: a router sends
`SetRole`, the engine applies it here and publishes its current role in every load report, and
every router replica builds its pools from those reports. Pure (no clock of its own): callers
pass `now` (time.monotonic()).

- `SetRole(mixed, lease_s)` lends the engine until `now + lease_s`; another one renews the lease.
- `SetRole(home)` returns it at once.
- A lease that runs out returns it too: a router that died mid-borrow strands nothing.

- `SetRole(role, home=role)` moves its home there (`rehome`, common/scheduling/home_roles.py).

All are idempotent, so two routers sending the same change converge; a router that wants an
engine mixed while another sends it home simply borrows it again on its next placement.
"""

from __future__ import annotations

from common.roles import Role

LENDABLE = (Role.PROMPT, Role.TOKEN)  # a mixed (non-split) engine is in its home pool already


class RoleLease:
    """Home role, current role, and when a mixed stint ends unless renewed."""

    def __init__(self, home: Role) -> None:
        self.home = home
        self._lent_until: float | None = None  # None: at home
        self.num_loans = 0  # stints in the mixed pool since start (stats and tests)
        self.num_home_moves = 0  # home changes since start (stats and tests)

    def rehome(self, home: Role) -> None:
        """A new home, served in at once (a loan ends). Only an engine role is a home."""
        if home not in (*LENDABLE, Role.MIXED):
            raise ValueError(f"an engine's home cannot be {home}")
        if home != self.home:
            self.num_home_moves += 1
        self.home, self._lent_until = home, None

    def set(self, role: Role, lease_s: float, now: float) -> None:
        """Apply a `SetRole`. A role other than home or mixed is refused (ValueError)."""
        if role == self.home:
            self._lent_until = None
        elif role == Role.MIXED and self.home in LENDABLE:
            if lease_s <= 0:
                raise ValueError("lending an engine to the mixed pool needs a positive lease")
            if self.current(now) == self.home:
                self.num_loans += 1
            self._lent_until = now + lease_s
        else:
            raise ValueError(f"an engine whose home is {self.home} cannot serve as {role}")

    def current(self, now: float) -> Role:
        """The pool the engine serves in at `now` (home again once its lease ran out)."""
        if self._lent_until is not None and now >= self._lent_until:
            self._lent_until = None
        return self.home if self._lent_until is None else Role.MIXED
