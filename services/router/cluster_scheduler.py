"""Where the router sends a request in the mesh: JSQ over the live engines' load reports.

`ClusterScheduler` adapts the pure cluster policy (`common.scheduling.cluster.JSQPoolPolicy`,
Splitwise §IV-A) to a membership that changes at run time: engines are keyed by service id,
given stable integer machine ids, and the policy is rebuilt when the set of ready engines
changes. The prompt engine and the token engine are chosen together; the shard group is the token
engine's own.

Pools are the engines' state (`pool_state.py`): the policy's table is set from their reports
before each decision, a borrow or return becomes a `SetRole` the router sends
(`take_role_changes`), and a lent engine's lease is renewed while it still has borrowed work.
With `PoolThresholds.home_roles`, engines' homes follow the queue mix too
(`common.scheduling.home_roles.HomeRolePolicy`, the simulator's same policy): its moves are
`SetRole`s with a new home, judged against the homes the registry lists (the deployments').

Load reports arrive every 50 ms per engine; between two reports the router adds what it just
placed to its copy of the chosen engines' load, so a burst of admissions does not all land on the
engine that looked shortest in the last report. A report holds only the requests the engine had
read when it made it, and an engine reads its commands between steps: a placement still on the
way, or queued behind a step, would vanish from the router's view until the next report. So each
report counts the requests it received from each router (`LoadReport.received_requests`), and a
router re-adds its placements past that count (`_Placement`) to what the report says.

A request's decode load belongs to its token engine long before that engine can report it:
while the prompt engine prefills it, the prompt engine reports it (`LoadReport.handoff_tokens`,
by token engine), and a token engine's load is its own report plus what every prompt engine
holds for it. So the router's placement lasts until a report of the prompt engine holds it, not
the token engine's: a token engine's report, made before the hand-offs it is about to get, no
longer erases them and sends the next requests to it as well.

KV-aware routing (docs/prefix_caching.md): each report also carries the engine's prefix-cache
news (`common.kv_events`), replayed into one `CachedBlocks` per engine. With a positive
`prefix_weight`, a request's prompt is hashed with the engines' own chain (`common.block_hash`)
and each prompt-capable engine is credited with the prefix it caches. An engine that leaves the
registry takes its hashes with it.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from common.block_hash import block_hashes, namespace_seed
from common.kv_events import CachedBlocks, CacheDigest, reusable_blocks
from common.protocol import LoadReport, SetRole
from common.roles import Role
from common.scheduling.cluster import (
    JSQPoolPolicy,
    MachineLoad,
    PoolThresholds,
    RouteRequest,
    with_kv_room,
)
from common.scheduling.home_roles import HomeRolePolicy, token_capable
from common.scheduling.shard_choice import ShardKvLoads, holds_whole_requests
from services.mesh.registry import ServiceEntry
from services.router.pool_state import ReportedPools

# A placement no report has counted after this long was never received (its send failed, or
# the engine is stuck and about to leave the registry): it stops counting.
PLACEMENT_TTL_S = 5.0


# KV admission on a token engine with a shard group counts a request's tokens now and at most
# this many more: its KV there grows on demand, and the token engine preempts (and recomputes)
# requests when the group runs out (services/engine/admission.py). One without counts its whole
# length (its own cache admits a hand-off only when the whole length fits).
KV_GROW_HEADROOM_TOKENS = 64


def kv_grow_tokens(num_tokens: int, max_new_tokens: int) -> int:
    """What a request of `num_tokens` tokens that may generate `max_new_tokens` more needs on a
    shard group to be admitted."""
    return num_tokens + min(max_new_tokens, KV_GROW_HEADROOM_TOKENS)


class NoEngines(LookupError):
    """No ready prompt engine or no ready token engine to place a request on."""


class NoKvRoom(LookupError):
    """No token engine has free KV for the request's whole length now (it waits at the router);
    `ever` False: none ever could (its whole length is more than any holds in all)."""

    def __init__(self, kv_tokens: int, most_tokens: int, ever: bool) -> None:
        where = "free now" if ever else "in all"
        super().__init__(f"the request needs {kv_tokens} KV tokens; the most any token engine "
                         f"has {where} is {most_tokens}")  # fmt: skip
        self.ever = ever


@dataclass(frozen=True)
class _KvHold:
    """One placement's whole-length KV, held on its token engine's free KV until a report of
    that engine counts its hand-off (`seq`: this router's count of placements handed there)."""

    seq: int
    at: float  # time.monotonic() when placed; held at most PLACEMENT_TTL_S
    kv_tokens: int
    req_id: str


@dataclass(frozen=True)
class _Placement:
    """What one request placed on a prompt engine adds to the loads until a report holds it: its
    prompt (less the cached prefix) pending there, and its tokens' decode load on the token
    engine, held by the prompt engine for it or, where it decodes there itself, its own."""

    seq: int  # the router's count of requests sent to that prompt engine, this one included
    at: float  # time.monotonic() when placed
    prompt_id: int
    token_id: int
    pending_tokens: int
    decode_tokens: int
    decodes_there: bool
    kv_tokens: int = 0  # its whole length: the KV it will hold on the token engine


class ClusterScheduler:
    """JSQ placement over the ready engines; thread-safe (reports arrive on the IO thread)."""

    def __init__(
        self,
        block_size: int,
        thresholds: PoolThresholds | None = None,
        *,
        prefix_weight: float = 0.0,
        cache_namespace: str = "",
        reply_endpoint: str = "",
    ) -> None:
        self.block_size = block_size
        # This router's inbox: the key of its requests in the engines' `received_requests`.
        self.reply_endpoint = reply_endpoint
        self.thresholds = thresholds or PoolThresholds()
        self.prefix_weight = prefix_weight  # 0: plain JSQ, prompts are not even hashed
        self.seed = namespace_seed(cache_namespace)  # the engines' (their model folder's name)
        self._lock = threading.Lock()
        self._machine_ids: dict[str, int] = {}  # service id -> machine id, stable for its life
        self._next_id = itertools.count()
        self._engines: dict[int, ServiceEntry] = {}
        self._loads: dict[int, MachineLoad] = {}  # each engine's own report (+ placements since)
        # Decode tokens each prompt engine holds for each token engine (its report, + placements
        # since): a token engine's load before its hand-offs land.
        self._handoffs: dict[int, dict[int, int]] = {}
        # KV admission: per token engine, this router's placements whose hand-off its reports do
        # not count yet (oldest first), each holding its whole length of that engine's free KV.
        self._kv_held: dict[int, deque[_KvHold]] = {}
        self._num_handed: dict[int, int] = {}  # placements handed to each token engine, in all
        self._by_endpoint: dict[str, int] = {}  # command endpoint -> machine id
        self._policy: JSQPoolPolicy | None = None
        self._homes: HomeRolePolicy | None = None  # with `thresholds.home_roles`
        self._req_ids = itertools.count()
        self._linked: dict[int, list[str]] = {}  # each token engine's group, as it last reported
        self._live_shards: set[str] = set()  # the registry's shards (their KV endpoints)
        self._cached: dict[int, CachedBlocks] = {}  # each engine's prefix cache, from its reports
        self._pools = ReportedPools(self.thresholds.role_lease_s)
        self._shard_loads = ShardKvLoads()  # request-partitioned groups: KV tokens per shard
        # Per prompt engine: requests sent to it, and those its last report did not hold yet.
        self._num_placed: dict[int, int] = {}
        self._unreported: dict[int, deque[_Placement]] = {}

    def set_engines(self, entries: list[ServiceEntry]) -> None:
        """The registry's ready services now (shards included: a token engine's group must be
        live to be placed on); rebuilds the policy if the set of engines changed."""
        with self._lock:
            engines = {self._machine_id(e.service_id): e for e in entries if e.is_engine}
            self._live_shards = {e.kv_endpoint for e in entries if e.role == Role.SHARD}
            changed = engines.keys() != self._engines.keys()
            self._engines = engines
            self._loads = {m: self._loads.get(m, MachineLoad(m)) for m in engines}
            self._by_endpoint = {e.command_endpoint: m for m, e in engines.items()}
            self._handoffs = {p: {t: n for t, n in held.items() if t in engines}
                              for p, held in self._handoffs.items() if p in engines}  # fmt: skip
            self._kv_held = {t: held for t, held in self._kv_held.items() if t in engines}
            self._cached = {m: self._cached.get(m) or CachedBlocks() for m in engines}
            self._num_placed = {m: n for m, n in self._num_placed.items() if m in engines}
            self._unreported = {
                p: deque(x for x in placed if x.token_id in engines)
                for p, placed in self._unreported.items() if p in engines
            }  # fmt: skip
            self._pools.forget_all_but(engines)
            if changed:
                homes = {m: Role(e.role) for m, e in engines.items()}
                self._policy = (
                    JSQPoolPolicy(homes, self.thresholds, self.prefix_weight)
                    if self._can_split()
                    else None
                )
                self._set_deployed(homes)

    def _set_deployed(self, homes: dict[int, Role]) -> None:
        """The home-role policy over the engines now (its hold and cool-down carry over). A
        prompt engine receives no KV (it is built without a receiver): it never decodes others'
        prompts, so its home stays prompt."""
        if self.thresholds.home_roles is None or self._policy is None:
            return
        prompt_only = {m for m, home in homes.items() if home == Role.PROMPT}
        if self._homes is None:
            self._homes = HomeRolePolicy(self.thresholds, homes, prompt_only)
        else:
            self._homes.set_deployed(homes, prompt_only)

    def on_load(self, report: LoadReport) -> None:
        """The latest report of one engine replaces the router's estimate of its load."""
        with self._lock:
            machine_id = self._machine_ids.get(report.engine_id)
            if machine_id is None or machine_id not in self._engines:
                return  # not (or no longer) routable
            total = report.total_kv_blocks * self.block_size if report.total_kv_blocks else None
            self._loads[machine_id] = MachineLoad(
                machine_id,
                pending_prompt_tokens=report.pending_prompt_tokens,
                decode_tokens=report.running_decode_tokens,
                free_kv_tokens=report.free_kv_blocks * self.block_size,
                total_kv_tokens=1 << 62 if total is None else total,
            )
            self._handoffs[machine_id] = {
                self._by_endpoint[endpoint]: tokens
                for endpoint, tokens in report.handoff_tokens.items()
                if endpoint in self._by_endpoint  # a token engine gone meanwhile: nothing lands
            }
            self._release_kv_held(machine_id, report.received_handoffs.get(self.reply_endpoint, 0))
            self._readd_unreported(machine_id, report)
            self._linked[machine_id] = report.shard_endpoints
            if report.shard_kv_tokens:
                self._shard_loads.on_report(report.shard_endpoints, report.shard_kv_tokens)
            self._pools.on_report(machine_id, report)
            if report.kv_seq:
                self._cached[machine_id].apply(
                    CacheDigest(report.kv_seq, report.kv_snapshot, report.kv_added,
                                report.kv_removed)
                )  # fmt: skip

    def can_place(self) -> bool:
        with self._lock:
            return self._policy is not None

    def choose(
        self,
        prompt_len: int,
        prompt_ids: Sequence[int] = (),
        kv_tokens: int = 0,
        req_id: str = "",
        kv_grow: int = 0,
    ) -> tuple[ServiceEntry, ServiceEntry]:
        """(prompt engine, token engine) for a new request of `prompt_len` tokens; given its
        `prompt_ids`, KV-aware (the prefix each engine caches is credited). With `kv_tokens`
        (its whole length), only a token engine with room for it is chosen (KV admission:
        `NoKvRoom` when none has it now): `kv_grow` free KV tokens on one with a shard group
        (`kv_grow_tokens`; 0: the whole length there too), the whole length on one without;
        `req_id` names its hold until the token engine counts it (`released`)."""
        hashes = self._prompt_hashes(prompt_len, prompt_ids)  # outside the lock: pure work
        with self._lock:
            if self._policy is None:
                raise NoEngines("no ready prompt and token engines")
            cached = {m: c.prefix_blocks(hashes) * self.block_size for m, c in self._cached.items()}
            request = RouteRequest(next(self._req_ids), prompt_len, cached)
            now = time.monotonic()
            loads = self._with_handoffs()  # once: rebalancing moves pools, not loads
            self._rebalance(self._policy, now, loads)
            need = self._kv_need(kv_tokens, kv_grow) if kv_tokens else {}
            if kv_tokens:  # before the policy moves pools: a refusal changes nothing
                loads = self._with_held_kv(loads)
                self._check_kv_room(loads, kv_tokens, need)
            decision = self._policy.route(request, loads, now)
            self._pools.ask(decision.moves, now)
            prompt_id, token_id = decision.prompt_machine_id, decision.token_machine_id
            if kv_tokens:
                room = with_kv_room(token_id, self._token_capable(), loads, need)
                token_id = token_id if room is None else room
            token = self._one_shard(self._linked_group(token_id), prompt_len)
            # A mixed engine decodes its own prompt where its KV is: itself, when the request
            # goes to no shards (its `Engine.on_generate` decides the same from the request).
            decodes_there = prompt_id == token_id and not token.shards
            self._account(prompt_id, token_id, prompt_len, request.cached_on(prompt_id),
                          decodes_there, kv_tokens)  # fmt: skip
            if kv_tokens and not decodes_there:
                self._hold_kv(token_id, need[token_id], req_id)
            self._cached[prompt_id].expect(hashes)
            return self._engines[prompt_id], token

    def _token_capable(self) -> list[int]:
        if self._policy is None:
            return [m for m, e in self._engines.items() if token_capable(Role(e.role))]
        return [m for m in self._engines if token_capable(self._policy.pools.home[m])]

    def check_ever_fits(self, kv_tokens: int) -> None:
        """`NoKvRoom(ever=False)` if no token-capable engine holds `kv_tokens` of KV in all."""
        with self._lock:
            self._check_ever_fits(self._loads, kv_tokens)

    def _check_ever_fits(self, loads: dict[int, MachineLoad], kv_tokens: int) -> None:
        most = max((loads[m].total_kv_tokens for m in self._token_capable() if m in loads),
                   default=1 << 62)  # fmt: skip
        if most < kv_tokens:
            raise NoKvRoom(kv_tokens, most, ever=False)

    def _kv_need(self, kv_tokens: int, kv_grow: int) -> dict[int, int]:
        """The free KV tokens each token-capable engine must have to take a request (`choose`)."""
        grows = {m: bool(kv_grow and self._linked_group(m).shards) for m in self._token_capable()}
        return {m: kv_grow if g else kv_tokens for m, g in grows.items()}

    def _check_kv_room(
        self, loads: dict[int, MachineLoad], kv_tokens: int, need: dict[int, int]
    ) -> None:
        """`NoKvRoom` unless some token-capable engine has the free KV it `need`s."""
        self._check_ever_fits(loads, kv_tokens)
        if need and not any(loads[m].free_kv_tokens >= n for m, n in need.items()):
            free = max(loads[m].free_kv_tokens for m in need)
            raise NoKvRoom(min(need.values()), free, ever=True)

    def _with_held_kv(self, loads: dict[int, MachineLoad]) -> dict[int, MachineLoad]:
        """Each token engine's free KV less the whole length of this router's placements its
        reports do not count yet."""
        oldest = time.monotonic() - PLACEMENT_TTL_S
        held = {m: sum(h.kv_tokens for h in holds if h.at >= oldest)
                for m, holds in self._kv_held.items()}  # fmt: skip
        return {m: replace(load, free_kv_tokens=load.free_kv_tokens - held[m]) if held.get(m)
                else load for m, load in loads.items()}  # fmt: skip

    def _hold_kv(self, token_id: int, kv_tokens: int, req_id: str) -> None:
        seq = self._num_handed.get(token_id, 0) + 1
        self._num_handed[token_id] = seq
        hold = _KvHold(seq, time.monotonic(), kv_tokens, req_id)
        self._kv_held.setdefault(token_id, deque()).append(hold)

    def _release_kv_held(self, token_id: int, received: int) -> None:
        """A report of `token_id` counts `received` of this router's hand-offs: so many of its
        holds, oldest first, are in its free KV now (hand-offs from several prompt engines may
        arrive out of order: the count, not the ids, is what the report's room reflects)."""
        held = self._kv_held.get(token_id)
        if not held:
            return
        oldest = time.monotonic() - PLACEMENT_TTL_S
        while held and (held[0].seq <= received or held[0].at < oldest):
            held.popleft()

    def released(self, req_id: str) -> None:
        """A request ended at this router (finished, aborted, failed): a hold it still has goes
        (one that ended before its hand-off never reaches a token engine's count)."""
        with self._lock:
            for held in self._kv_held.values():
                for hold in held:
                    if hold.req_id == req_id:
                        held.remove(hold)
                        return

    def _one_shard(self, token: ServiceEntry, prompt_len: int) -> ServiceEntry:
        """A token engine whose group holds whole requests (`shard_partition: request`): the
        request goes to one shard of it, the one with the fewest KV tokens."""
        if not holds_whole_requests(token.shards):
            return token
        best = self._shard_loads.choose([s.kv_endpoint for s in token.shards], prompt_len)
        return replace(token, shards=(token.shards[best],))

    def rebalance(self) -> None:
        """Return drained lent engines home and renew the others' leases (the router calls this
        between placements too, so an idle router still returns what it borrowed)."""
        with self._lock:
            if self._policy is not None:
                self._rebalance(self._policy, time.monotonic(), self._with_handoffs())

    def take_role_changes(self) -> list[tuple[ServiceEntry, SetRole]]:
        """The `SetRole`s asked since the last call, for the router to send."""
        with self._lock:
            changes = [(self._engines[m], msg) for m, msg in self._pools.outbox
                       if m in self._engines]  # fmt: skip
            self._pools.outbox.clear()
            return changes

    def pools(self) -> dict[str, str]:
        """Each engine's current pool as the router sees it (its reports; for stats, metrics)."""
        with self._lock:
            if self._policy is None:
                return {e.service_id: str(e.role) for e in self._engines.values()}
            self._pools.sync(self._policy.pools, time.monotonic())
            current = self._policy.pools.current
            return {e.service_id: current[m].value for m, e in self._engines.items()}

    def _rebalance(self, policy: JSQPoolPolicy, now: float, loads: dict[int, MachineLoad]) -> None:
        self._pools.sync(policy.pools, now)
        if self._homes is not None:  # before the loans: a moved engine's loan ends with it
            for move in self._homes.observe(policy.pools.home, loads, now):
                policy.pools.apply(move, now)
                self._pools.rehome(move.machine_id, move.to_pool, now)
        moves = policy.rebalance(loads, now)
        # A return home judged on a report that may predate the borrowed work is not sent; the
        # table goes back to the engines' word (the policy applied every move it returned).
        sent = [m for m in moves if m.repurposed or self._pools.releasable(m.machine_id)]
        self._pools.ask(sent, now)
        if len(sent) < len(moves):
            self._pools.sync(policy.pools, now)
        self._pools.renew(policy.pools, now)

    def cached_blocks(self) -> dict[str, int]:
        """How many block hashes the router believes each engine caches (for tests and stats)."""
        with self._lock:
            return {e.service_id: len(self._cached[m].hashes) for m, e in self._engines.items()}

    def _prompt_hashes(self, prompt_len: int, prompt_ids: Sequence[int]) -> list[int]:
        if self.prefix_weight == 0 or not prompt_ids:
            return []
        num_blocks = reusable_blocks(prompt_len, self.block_size)
        return block_hashes(prompt_ids[: num_blocks * self.block_size], self.block_size, self.seed)

    def loads(self) -> dict[str, MachineLoad]:
        """The current estimate per engine service id (for stats and tests)."""
        with self._lock:
            loads = self._with_handoffs()
            return {e.service_id: loads[m] for m, e in self._engines.items()}

    def _with_handoffs(self) -> dict[int, MachineLoad]:
        """Each engine's load with the decode tokens prompt engines hold for it added."""
        coming: dict[int, int] = {}
        for held in self._handoffs.values():
            for token_id, tokens in held.items():
                coming[token_id] = coming.get(token_id, 0) + tokens
        if not coming:
            return self._loads
        return {m: replace(load, decode_tokens=load.decode_tokens + coming[m]) if m in coming
                else load for m, load in self._loads.items()}  # fmt: skip

    def _account(
        self,
        prompt_id: int,
        token_id: int,
        prompt_len: int,
        cached: int,
        decodes_there: bool,
        kv_tokens: int,
    ) -> None:
        seq = self._num_placed.get(prompt_id, 0) + 1
        self._num_placed[prompt_id] = seq
        placement = _Placement(seq, time.monotonic(), prompt_id, token_id, prompt_len - cached,
                               prompt_len, decodes_there, kv_tokens)  # fmt: skip
        self._unreported.setdefault(prompt_id, deque()).append(placement)
        self._add(placement)

    def _add(self, placement: _Placement) -> None:
        # Until a report of the prompt engine holds it: the prompt is pending there, and will
        # decode on the token engine: held for it (`_handoffs`) if the prompt engine hands it
        # off, on the engine itself if it decodes it there (`decodes_there`: it reports the
        # request as its own, pending, then running).
        prompt_id, token_id = placement.prompt_id, placement.token_id
        p = self._loads[prompt_id]
        pending = p.pending_prompt_tokens + placement.pending_tokens
        self._loads[prompt_id] = replace(p, pending_prompt_tokens=pending)
        if placement.decodes_there:
            t = self._loads[token_id]
            decode = t.decode_tokens + placement.decode_tokens
            free = t.free_kv_tokens - placement.kv_tokens
            self._loads[token_id] = replace(t, decode_tokens=decode, free_kv_tokens=free)
            return
        held = self._handoffs.setdefault(prompt_id, {})
        held[token_id] = held.get(token_id, 0) + placement.decode_tokens

    def _readd_unreported(self, prompt_id: int, report: LoadReport) -> None:
        """The placements on `prompt_id` that its fresh `report` does not hold, added back to it:
        those past the count of this router's requests it had received (FIFO: the router sends
        them in placement order, give or take threads racing to send), unless too old."""
        placed = self._unreported.get(prompt_id)
        if not placed:
            return
        received = report.received_requests.get(self.reply_endpoint, 0)
        oldest = time.monotonic() - PLACEMENT_TTL_S
        while placed and (placed[0].seq <= received or placed[0].at < oldest):
            placed.popleft()
        for placement in placed:  # their token engines are live: `set_engines` keeps no other
            self._add(placement)

    def _linked_group(self, machine_id: int) -> ServiceEntry:
        """The token engine's entry with the shard group it has linked: its registry entry lags
        behind a lost shard (heartbeat age), its load report does not. A group that differs from
        the entry's is not used, nor one with a shard the registry no longer lists (the engine
        has not noticed yet): the request decodes with the engine's local attention."""
        entry = self._engines[machine_id]
        linked = self._linked.get(machine_id)
        group = [s.kv_endpoint for s in entry.shards]
        if (linked is None or linked == group) and self._live_shards.issuperset(group):
            return entry
        return replace(entry, shards=())

    def _machine_id(self, service_id: str) -> int:
        if service_id not in self._machine_ids:
            self._machine_ids[service_id] = next(self._next_id)
        return self._machine_ids[service_id]

    def _can_split(self) -> bool:
        """JSQ needs a prompt-capable and a token-capable engine (a mixed one is both)."""
        roles = {e.role for e in self._engines.values()}
        return "mixed" in roles or {"prompt", "token"} <= roles
