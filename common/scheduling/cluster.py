"""Cluster-level scheduling (Splitwise §IV-A): machine pools and request routing.

Pure: the input is plain per-machine load (what engines publish in their load reports), the output a
plain decision. The live router and the simulator call the same classes.

Pools. Every machine has a *home* pool (prompt, token, or mixed for non-split baselines) and a
current pool. `JSQPoolPolicy` routes each request to a prompt machine and a token machine at once,
by Join-the-Shortest-Queue on pending tokens. When the best machine's queue would pass a threshold
it looks in the mixed pool; when that is full too, it borrows the least-loaded machine of the
opposite pool and moves it into mixed. With a `prefix_weight`, a prompt-capable machine's queue
is credited with the request's prefix it already caches (KV-aware routing, as Dynamo's and llm-d's
routers do): its key is pending prompt tokens - weight x cached prefix tokens; weight 0 is plain
JSQ. `rebalance` sends a mixed machine home once no work of the
opposite kind is pending on it, and re-purposes (changes the home of) a machine that has stayed
mixed for long. `RoundRobinPolicy` and `PowerOfTwoPolicy` route within home pools, for comparison.

Lending bounds (`PoolThresholds.lend_prefill_max_decode` / `lend_decode_max_pending`, off by
default) keep lent work off a machine where it would stall what runs there. They read the same
reported loads as JSQ: a stale report may grant or refuse one loan it would not have a report
later (as it may pick a machine JSQ would not); a refused loan loses nothing, the work queues in
its own pool.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, NamedTuple

from common.roles import Role
from common.scheduling.load_board import (
    DECODE_FIGURE,
    PROMPT_FIGURE,
    TOTAL_FIGURE,
    LoadBoard,
    MachineLoad,
)

if TYPE_CHECKING:
    from common.scheduling.home_roles import HomeRoleThresholds

# Machine pools are engine roles: a split design's machines have home PROMPT or TOKEN; a
# baseline's, MIXED.
OPPOSITE = {Role.PROMPT: Role.TOKEN, Role.TOKEN: Role.PROMPT}


NO_CACHED_PREFIX: Mapping[int, int] = MappingProxyType({})
UNBOUNDED = 1 << 62  # a token count no machine reaches


class RouteRequest(NamedTuple):
    """What the router knows about a request at admission. `cached_prefix_tokens`: machine id ->
    tokens of this prompt's prefix that machine caches (as far as its reports tell); absent: 0.
    (Requests and decisions are named tuples: the simulator routes millions.)"""

    req_id: int
    prompt_len: int
    cached_prefix_tokens: Mapping[int, int] = NO_CACHED_PREFIX

    def cached_on(self, machine_id: int) -> int:
        return self.cached_prefix_tokens.get(machine_id, 0)


@dataclass(frozen=True)
class PoolMove:
    """Move `machine_id` into `to_pool`; `repurposed` when its home pool changes too."""

    machine_id: int
    to_pool: Role
    repurposed: bool = False


class RouteDecision(NamedTuple):
    """Where a request runs. Same id twice means no KV transfer. `moves` apply before it runs."""

    prompt_machine_id: int
    token_machine_id: int
    moves: tuple[PoolMove, ...] = ()


@dataclass(frozen=True)
class PoolThresholds:
    """When JSQ's best target counts as full, and how long a mixed stint is 'long'."""

    prompt_tokens: int = 8192
    decode_tokens: int = 1 << 62
    min_free_kv_tokens: int = 0
    repurpose_after_s: float = 600.0
    min_mixed_s: float = 0.0
    # The live mesh only: how long an engine lent to mixed stays there without a renewing
    # `SetRole` (common/scheduling/role_lease.py); routers renew every third of it.
    role_lease_s: float = 10.0
    # Homes that follow the queue mix (common/scheduling/home_roles.py); None: homes stay.
    home_roles: HomeRoleThresholds | None = None
    # Lending that stalls no one already served there (unbounded: Splitwise's lending). A
    # prefill away from home (on a mixed machine, or a token machine borrowed) goes only to a
    # machine running at most `lend_prefill_max_decode` decode tokens: the iteration that
    # prefills it stalls every decode running there for the whole prefill. A prompt machine is
    # borrowed for a decode only with at most `lend_decode_max_pending` prompt tokens pending:
    # the decode would wait behind them, and a busy prompt pool needs the machine. (A decode
    # still goes to a machine already mixed: that one is out of the prompt pool already.)
    # Refused, the work stays in its own pool past the "full" mark (it queues there).
    lend_prefill_max_decode: int = UNBOUNDED
    lend_decode_max_pending: int = UNBOUNDED

    def __post_init__(self) -> None:
        if self.prompt_tokens <= 0 or self.repurpose_after_s <= 0 or self.role_lease_s <= 0:
            raise ValueError(
                "pool thresholds: prompt_tokens, repurpose_after_s and role_lease_s must be "
                "positive"
            )
        if self.lend_prefill_max_decode < 0 or self.lend_decode_max_pending < 0:
            raise ValueError(
                "pool thresholds: lend_prefill_max_decode and lend_decode_max_pending must not "
                "be negative"
            )

    def lend_bound(self, kind: Role, borrowing: bool) -> int:
        """The most of the other kind of work a machine away from its home may run and still
        take work of `kind` (already mixed, or `borrowing` it): decode tokens for a prefill,
        pending prompt tokens for a decode on a prompt machine borrowed."""
        if kind == Role.PROMPT:
            return self.lend_prefill_max_decode
        return self.lend_decode_max_pending if borrowing else UNBOUNDED


class PoolTable:
    """Home and current pool of every machine, and when each entered the mixed pool.

    Members are kept per pool (machines move rarely; routing asks for a pool's members on every
    request). `on_move`, when set, hears of every machine whose current pool changed (a
    `LoadBoard` re-files it)."""

    def __init__(self, homes: Mapping[int, Role]) -> None:
        if not homes:
            raise ValueError("pool table: no machines")
        self.home: dict[int, Role] = dict(homes)
        self.current: dict[int, Role] = dict(homes)
        self.mixed_since: dict[int, float] = {}
        self.on_move: Callable[[int], None] | None = None
        self._position = {m: i for i, m in enumerate(self.current)}  # members keep this order
        self._members: dict[Role, set[int]] = {pool: set() for pool in Role}
        for machine_id, pool in self.current.items():
            self._members[pool].add(machine_id)
        self._num_split_homes = sum(p != Role.MIXED for p in self.home.values())
        self._lent: set[int] = set()  # in the mixed pool, away from another home

    def members(self, pool: Role) -> list[int]:
        return sorted(self._members[pool], key=self._position.__getitem__)

    def member_set(self, pool: Role) -> AbstractSet[int]:
        """The pool's members, unordered (not to be changed)."""
        return self._members[pool]

    def size(self, pool: Role) -> int:
        return len(self._members[pool])

    def lent(self) -> list[int]:
        """The mixed pool's members whose home is another pool, in `members` order."""
        if not self._lent:  # the common case: asked at every routing
            return []
        return sorted(self._lent, key=self._position.__getitem__)

    def home_members(self, pool: Role) -> list[int]:
        return [m for m, p in self.home.items() if p is pool]

    def apply(self, move: PoolMove, now: float) -> None:
        machine_id = move.machine_id
        if move.repurposed:
            self._set_home(machine_id, move.to_pool)
        if move.to_pool == Role.MIXED and self.home[machine_id] != Role.MIXED:
            self.mixed_since[machine_id] = now
        else:
            self.mixed_since.pop(machine_id, None)
        before = self.current[machine_id]
        self.current[machine_id] = move.to_pool
        self._file_lent(machine_id)
        if before != move.to_pool:
            self._members[before].discard(machine_id)
            self._members[move.to_pool].add(machine_id)
            if self.on_move is not None:
                self.on_move(machine_id)

    def _set_home(self, machine_id: int, pool: Role) -> None:
        self._num_split_homes += (pool != Role.MIXED) - (self.home[machine_id] != Role.MIXED)
        self.home[machine_id] = pool
        self._file_lent(machine_id)

    def _file_lent(self, machine_id: int) -> None:
        if self.current[machine_id] == Role.MIXED and self.home[machine_id] != Role.MIXED:
            self._lent.add(machine_id)
        else:
            self._lent.discard(machine_id)

    def sync(self, reported: Mapping[int, tuple[Role, Role]], now: float) -> None:
        """Take each machine's (home, current) pool as it says it is: in the live mesh the pools
        are the engines' state (their load reports), and a policy's moves only ask for changes."""
        for machine_id, (home, current) in reported.items():
            if machine_id not in self.current:
                continue
            self._set_home(machine_id, home)
            if current != self.current[machine_id]:
                self.apply(PoolMove(machine_id, current), now)

    @property
    def is_split(self) -> bool:
        return self._num_split_homes > 0


LoadKey = Callable[[MachineLoad], float]


def prompt_load(load: MachineLoad) -> int:
    return load.pending_prompt_tokens


def decode_load(load: MachineLoad) -> int:
    return load.decode_tokens


def total_load(load: MachineLoad) -> int:
    return load.pending_prompt_tokens + load.decode_tokens


# The load keys by the figure a `LoadBoard` files them under.
FIGURE_KEYS: dict[int, LoadKey] = {
    PROMPT_FIGURE: prompt_load,
    DECODE_FIGURE: decode_load,
    TOTAL_FIGURE: total_load,
}


def prefix_credited(key: LoadKey, request: RouteRequest, weight: float) -> LoadKey:
    """`key` less `weight` x the request's prefix cached on the machine (KV-aware JSQ)."""
    if weight == 0 or not request.cached_prefix_tokens:
        return key
    return lambda load: key(load) - weight * request.cached_on(load.machine_id)


def reported(loads: Mapping[int, MachineLoad], machine_id: int) -> tuple[int, int, int]:
    """(pending prompt, decode, free KV) tokens of a machine, from a dict of loads or a
    `LoadBoard` (its figures as reported, no `MachineLoad` built)."""
    if isinstance(loads, LoadBoard):
        pending, decode, _, free = loads.figures(machine_id)
        return pending, decode, free
    load = loads[machine_id]
    return load.pending_prompt_tokens, load.decode_tokens, load.free_kv_tokens


def shortest(ids: Iterable[int], loads: Mapping[int, MachineLoad], key: LoadKey) -> int | None:
    """The id with the least `key(load)`, lowest id on ties; None for no ids."""
    best = min(ids, key=lambda m: (key(loads[m]), m), default=None)
    return best


def with_kv_room(
    preferred: int,
    candidates: Iterable[int],
    loads: Mapping[int, MachineLoad],
    kv_tokens: int | Mapping[int, int],
) -> int | None:
    """KV admission: `preferred` if its free KV holds what a request needs there (`kv_tokens`,
    or `kv_tokens[m]` where machines differ), else the least decode-loaded of `candidates` that
    does, else None (the request waits)."""

    def fits_on(m: int) -> bool:
        need = kv_tokens.get(m, 1 << 62) if isinstance(kv_tokens, Mapping) else kv_tokens
        return loads[m].free_kv_tokens >= need

    if fits_on(preferred):
        return preferred
    fits = [m for m in candidates if fits_on(m)]
    return shortest(fits, loads, decode_load)


class JSQPoolPolicy:
    """Splitwise's cluster-level scheduler: JSQ on pending tokens with a mixed pool."""

    def __init__(
        self,
        homes: Mapping[int, Role],
        thresholds: PoolThresholds | None = None,
        prefix_weight: float = 0.0,
    ) -> None:
        if prefix_weight < 0:
            raise ValueError("JSQ: prefix_weight must be >= 0")
        self.pools = PoolTable(homes)
        self.thresholds = thresholds or PoolThresholds()
        self.prefix_weight = prefix_weight

    def route(
        self, request: RouteRequest, loads: Mapping[int, MachineLoad], now: float
    ) -> RouteDecision:
        """Pick the prompt and token machine together; borrow machines into mixed if needed.
        `loads`: every machine's, a dict or a `LoadBoard` (the same decision, found faster)."""
        if not self.pools.is_split:
            target = self._least(Role.MIXED, loads, TOTAL_FIGURE, request)
            assert target is not None
            return RouteDecision(target, target)
        moves: list[PoolMove] = []
        prompt_id = self._pick(Role.PROMPT, request, loads, now, moves)
        token_id = self._pick(Role.TOKEN, request, loads, now, moves)
        return RouteDecision(prompt_id, token_id, tuple(moves))

    def _least(
        self,
        pool: Role,
        loads: Mapping[int, MachineLoad],
        figure: int,
        request: RouteRequest | None = None,
    ) -> int | None:
        """The pool's least-loaded member by `figure`, credited with the prefix each caches
        when `request` is given (KV-aware JSQ); lowest id on ties."""
        if isinstance(loads, LoadBoard):
            credit = request.cached_prefix_tokens if request is not None else None
            return loads.least(pool, figure, credit, self.prefix_weight)
        return self._least_among(self.pools.members(pool), loads, figure, request)

    def _least_among(
        self,
        ids: Iterable[int],
        loads: Mapping[int, MachineLoad],
        figure: int,
        request: RouteRequest | None = None,
    ) -> int | None:
        """`_least` over the machines `ids` (a pool's subset), searched one by one."""
        key = FIGURE_KEYS[figure]
        if request is not None:
            key = prefix_credited(key, request, self.prefix_weight)
        return shortest(ids, loads, key)

    def _pick(
        self,
        kind: Role,
        request: RouteRequest,
        loads: Mapping[int, MachineLoad],
        now: float,
        moves: list[PoolMove],
    ) -> int:
        # Only prefill reuses a cache: token machines keep none (their KV arrives shipped).
        if kind == Role.PROMPT:
            figure, credited = PROMPT_FIGURE, request
        else:
            figure, credited = DECODE_FIGURE, None
        own = self._least(kind, loads, figure, credited)
        if own is not None and not self._full(kind, own, loads, request):
            return own
        mixed = self._least_lendable(kind, Role.MIXED, loads, figure, credited)
        if mixed is not None and not self._full(kind, mixed, loads, request):
            return mixed
        # Both full: borrow from the opposite pool, keeping at least one machine there.
        donors = OPPOSITE[kind]
        # The donor is the machine least busy with anything (its own work included).
        borrowed = (
            self._least_lendable(kind, donors, loads, TOTAL_FIGURE)
            if self.pools.size(donors) > 1
            else None
        )
        if borrowed is not None:
            move = PoolMove(borrowed, Role.MIXED)
            self.pools.apply(move, now)
            moves.append(move)
            return borrowed
        candidates = [m for m in (own, mixed) if m is not None] or list(self.pools.current)
        fallback = self._least_among(candidates, loads, figure, credited)
        assert fallback is not None
        return fallback

    def _least_lendable(
        self,
        kind: Role,
        pool: Role,
        loads: Mapping[int, MachineLoad],
        figure: int,
        request: RouteRequest | None = None,
    ) -> int | None:
        """`_least` over the members of `pool`, a pool away from `kind`'s home, that may take
        work of `kind` (`PoolThresholds.lend_bound`: the other work they run is within it)."""
        bound = self.thresholds.lend_bound(kind, borrowing=pool != Role.MIXED)
        if bound >= UNBOUNDED:  # every member may: the indexed search
            return self._least(pool, loads, figure, request)
        other = 1 if kind == Role.PROMPT else 0  # its decode tokens, or its pending prompt ones
        lendable = [m for m in self.pools.members(pool) if reported(loads, m)[other] <= bound]
        return self._least_among(lendable, loads, figure, request)

    def _full(
        self, kind: Role, machine_id: int, loads: Mapping[int, MachineLoad], request: RouteRequest
    ) -> bool:
        pending, decode, free = reported(loads, machine_id)
        if kind == Role.PROMPT:  # it computes only the part of the prompt it does not cache
            new_tokens = request.prompt_len - request.cached_on(machine_id)
            return pending + new_tokens > self.thresholds.prompt_tokens
        need = request.prompt_len + self.thresholds.min_free_kv_tokens
        return decode > self.thresholds.decode_tokens or free < need

    def rebalance(self, loads: Mapping[int, MachineLoad], now: float) -> list[PoolMove]:
        """Send drained mixed machines home; re-purpose machines mixed for too long."""
        moves: list[PoolMove] = []
        for machine_id in self.pools.lent():  # a machine whose home is mixed stays there
            move = self._release(machine_id, loads[machine_id], now)
            if move is not None:
                self.pools.apply(move, now)
                moves.append(move)
        return moves

    def _release(self, machine_id: int, load: MachineLoad, now: float) -> PoolMove | None:
        home = self.pools.home[machine_id]
        if home == Role.MIXED:
            return None
        since = self.pools.mixed_since.get(machine_id, now)
        if now - since < self.thresholds.min_mixed_s:
            return None
        # "Opposite work" of a prompt machine is decoding, and of a token machine prefilling.
        opposite_pending = load.decode_tokens if home == Role.PROMPT else load.pending_prompt_tokens
        if opposite_pending == 0:
            return PoolMove(machine_id, home)
        if (
            now - since >= self.thresholds.repurpose_after_s
            and len(self.pools.home_members(home)) > 1
        ):
            return PoolMove(machine_id, OPPOSITE[home], repurposed=True)
        return None


class RoundRobinPolicy:
    """Cycle through each home pool independently (no mixed pool, no load)."""

    def __init__(self, homes: Mapping[int, Role]) -> None:
        self.pools = PoolTable(homes)
        self._next = {pool: 0 for pool in Role}

    def route(
        self, request: RouteRequest, loads: Mapping[int, MachineLoad], now: float
    ) -> RouteDecision:
        if not self.pools.is_split:
            target = self._cycle(Role.MIXED)
            return RouteDecision(target, target)
        return RouteDecision(self._cycle(Role.PROMPT), self._cycle(Role.TOKEN))

    def _cycle(self, pool: Role) -> int:
        members = sorted(self.pools.home_members(pool))
        chosen = members[self._next[pool] % len(members)]
        self._next[pool] += 1
        return chosen

    def rebalance(self, loads: Mapping[int, MachineLoad], now: float) -> list[PoolMove]:
        return []


class PowerOfTwoPolicy:
    """Sample two machines of each home pool; take the one with fewer pending tokens."""

    def __init__(self, homes: Mapping[int, Role], seed: int = 0) -> None:
        self.pools = PoolTable(homes)
        self._rng = random.Random(seed)

    def route(
        self, request: RouteRequest, loads: Mapping[int, MachineLoad], now: float
    ) -> RouteDecision:
        if not self.pools.is_split:
            target = self._two_choices(Role.MIXED, loads, total_load)
            return RouteDecision(target, target)
        prompt_id = self._two_choices(Role.PROMPT, loads, prompt_load)
        return RouteDecision(prompt_id, self._two_choices(Role.TOKEN, loads, decode_load))

    def _two_choices(self, pool: Role, loads: Mapping[int, MachineLoad], key: LoadKey) -> int:
        members = sorted(self.pools.home_members(pool))
        sample = self._rng.sample(members, min(2, len(members)))
        best = shortest(sample, loads, key)
        assert best is not None
        return best

    def rebalance(self, loads: Mapping[int, MachineLoad], now: float) -> list[PoolMove]:
        return []
