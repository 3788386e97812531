"""Home roles that follow the queue mix: Splitwise's coarse re-purposing of machines (§IV-A).

Lending (`JSQPoolPolicy`, `role_lease.py`) borrows an engine into the mixed pool for one burst
and returns it once its borrowed work is done. When the mix itself moves (a prompt-heavy phase
that lasts), `HomeRolePolicy` changes an engine's *home* instead, one step at a time along
prompt <-> mixed <-> token, and moves it back toward the home it was deployed with once the
mix has settled. The live router (services/router/cluster_scheduler.py) and the simulator
(loadgen/sim/simulator.py) run this same class. Pure: callers pass `now`.

The mix, per sample: how full the prompt side is against how full the decode side is,
both against the deployment's provisioning (so a move does not redefine the scale it is judged on):

- prompt fill: pending prompt tokens on every engine / (prompt-capable engines as deployed x
  `PoolThresholds.prompt_tokens`, JSQ's "a prompt engine is full");
- decode fill: running decode tokens on every engine / the KV (used + free) of the token-capable
  engines as deployed.

`gap = prompt fill - decode fill`. Hysteresis both ways: `gap >= shift` held for `hold_s` moves an
engine one step toward prompt (`gap <= -shift`: toward token); `|gap| <= settle` held for `hold_s`
moves a displaced engine one step back toward its deployed home; in between nothing moves and the
hold starts over. At most one move per `cooldown_s`, counted from the last home change the
policy made or saw (another router replica's move shows in the homes it is given). A move never
leaves the cluster without a prompt-capable (prompt or mixed home) or a token-capable (token or
mixed home) engine, nor gives a `prompt_only` machine a token-capable home. Which engine: one
whose step returns it toward its deployed home first, then the one with the fewest decode tokens
(its running requests keep decoding there), then the lowest id.

NOTE: the queue drains faster once an engine has moved, so a burst the moved engine alone
absorbs can look settled and send it back, and the next `hold_s` of backlog moves it again: the
cool-down bounds such a cycle to one move per `cooldown_s` (set it well above the burst
lengths that should not re-purpose anything).
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from common.roles import Role
from common.scheduling.cluster import PoolMove, PoolThresholds
from common.scheduling.load_board import MachineLoad

# prompt <-> mixed <-> token: an engine's place on the chain its home moves along.
_POSITION = {Role.PROMPT: -1, Role.MIXED: 0, Role.TOKEN: 1}
_AT = {p: role for role, p in _POSITION.items()}
TOWARD_PROMPT, TOWARD_TOKEN = -1, 1
# Samples per hold: the mix is read this often (a simulator's thousand machines are summed only
# then, not on every arrival).
SAMPLES_PER_HOLD = 8


@dataclass(frozen=True)
class HomeRoleThresholds:
    """When the mix counts as shifted (`shift`) or settled (`settle`), for how long (`hold_s`),
    and how long after a home change the next may come (`cooldown_s`). The gaps are between
    fills, fractions (see the module). `PoolThresholds.home_roles` carries them."""

    shift: float = 0.5
    settle: float = 0.1
    hold_s: float = 30.0
    cooldown_s: float = 120.0

    def __post_init__(self) -> None:
        if not 0 <= self.settle < self.shift:
            raise ValueError("home roles: 0 <= settle < shift (hysteresis)")
        if self.hold_s < 0 or self.cooldown_s < 0:
            raise ValueError("home roles: hold_s and cooldown_s must be >= 0")


def prompt_capable(home: Role) -> bool:
    return home in (Role.PROMPT, Role.MIXED)


def token_capable(home: Role) -> bool:
    return home in (Role.TOKEN, Role.MIXED)


class HomeRolePolicy:
    """Moves engines' homes as the queue mix shifts and settles (see the module)."""

    def __init__(
        self,
        pool_thresholds: PoolThresholds,
        deployed: Mapping[int, Role],
        prompt_only: AbstractSet[int] = frozenset(),
    ) -> None:
        if pool_thresholds.home_roles is None:
            raise ValueError("home roles: the pool thresholds set none")
        self.thresholds = pool_thresholds.home_roles
        self.prompt_tokens = pool_thresholds.prompt_tokens
        self.set_deployed(deployed, prompt_only)
        self._holding: tuple[int, float] | None = None  # (direction, 0 settled; since when)
        self._last_change_s = float("-inf")
        self._last_homes: dict[int, Role] | None = None
        self._next_sample_s = float("-inf")
        self.last_gap = 0.0  # the mix at the last sample (stats, tests)
        self.num_moves = 0

    def set_deployed(
        self, deployed: Mapping[int, Role], prompt_only: AbstractSet[int] = frozenset()
    ) -> None:
        """The engines and the homes they were deployed with (membership changed): the hold and
        the cool-down carry over. `prompt_only`: machines that cannot take decode work (the
        live mesh's prompt engines receive no KV), never given a token-capable home."""
        self.deployed = {m: home for m, home in deployed.items() if home in _POSITION}
        self.prompt_only = frozenset(prompt_only)
        self._num_prompt = sum(prompt_capable(h) for h in self.deployed.values())
        self._token_ids = [m for m, h in self.deployed.items() if token_capable(h)]

    def gap(self, loads: Mapping[int, MachineLoad]) -> float:
        """Prompt fill less decode fill now (the module's `gap`)."""
        pending = sum(loads[m].pending_prompt_tokens for m in self.deployed if m in loads)
        decode = sum(loads[m].decode_tokens for m in self.deployed if m in loads)
        kv = sum(
            loads[m].decode_tokens + loads[m].free_kv_tokens for m in self._token_ids if m in loads
        )
        prompt_fill = pending / max(self._num_prompt * self.prompt_tokens, 1)
        return prompt_fill - (decode / kv if kv > 0 else 0.0)

    def observe(
        self, homes: Mapping[int, Role], loads: Mapping[int, MachineLoad], now: float
    ) -> list[PoolMove]:
        """The home changes to make now (at most one): `homes` are the engines' homes as they
        are (a move made elsewhere counts for the cool-down from the sample that sees it),
        `loads` every engine's load. Between samples it returns at once."""
        if now < self._next_sample_s:
            return []
        self._next_sample_s = now + self.thresholds.hold_s / SAMPLES_PER_HOLD
        homes = {m: homes[m] for m in self.deployed if m in homes}
        last = self._last_homes or {}
        if any(last.get(m, home) != home for m, home in homes.items()):  # an engine that came
            self._last_change_s = max(self._last_change_s, now)  # or went is no move
        self._last_homes = homes
        self.last_gap = gap = self.gap(loads)
        t = self.thresholds
        direction = TOWARD_PROMPT if gap >= t.shift else TOWARD_TOKEN if gap <= -t.shift else None
        if direction is None and abs(gap) <= t.settle:
            direction = 0  # settled: displaced engines may go home
        if direction is None or self._holding is None or self._holding[0] != direction:
            self._holding = None if direction is None else (direction, now)
        if self._holding is None or now - self._holding[1] < t.hold_s:
            return []
        if now - self._last_change_s < t.cooldown_s:
            return []
        move = self._step(direction or 0, homes, loads)
        if move is None:
            return []
        self._last_change_s = now
        self._last_homes = {**homes, move.machine_id: move.to_pool}
        self.num_moves += 1
        return [move]

    def _step(
        self, direction: int, homes: Mapping[int, Role], loads: Mapping[int, MachineLoad]
    ) -> PoolMove | None:
        """The one move this direction asks for (0: a displaced engine back toward its deployed
        home), or None where no engine may take it."""
        candidates = []
        for machine_id, home in homes.items():
            position = _POSITION.get(home)
            if position is None:
                continue
            toward_home = _POSITION[self.deployed[machine_id]] - position
            step = direction or (toward_home > 0) - (toward_home < 0)
            if step == 0 or not -1 <= position + step <= 1:
                continue
            to_home = _AT[position + step]
            if machine_id in self.prompt_only and token_capable(to_home):
                continue
            if not self._keeps_both(homes, machine_id, to_home):
                continue
            returning = toward_home * step > 0
            load = loads.get(machine_id)
            decode = load.decode_tokens if load is not None else 0
            candidates.append((not returning, decode, machine_id, to_home))
        if not candidates:
            return None
        _, _, machine_id, to_home = min(candidates)
        return PoolMove(machine_id, to_home, repurposed=True)

    @staticmethod
    def _keeps_both(homes: Mapping[int, Role], machine_id: int, to_home: Role) -> bool:
        after = {**homes, machine_id: to_home}.values()
        return any(map(prompt_capable, after)) and any(map(token_capable, after))


__all__ = ["HomeRolePolicy", "HomeRoleThresholds", "prompt_capable", "token_capable"]
