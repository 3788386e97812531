"""Where the router sends a request in the mesh: JSQ over the live engines' load reports.

`ClusterScheduler` adapts the pure cluster policy (`common.scheduling.cluster.JSQPoolPolicy`,
Splitwise §IV-A) to a membership that changes at run time: engines are keyed by service id,
given stable integer machine ids, and the policy is rebuilt when the set of ready engines
changes. The prompt engine and the token engine are chosen together; the shard group is the token
engine's own.

Load reports arrive every 50 ms per engine; between two reports the router adds what it just
placed to its copy of the chosen engines' load, so a burst of admissions does not all land on the
engine that looked shortest in the last report.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import replace

from common.protocol import LoadReport
from common.roles import Role
from common.scheduling.cluster import (
    JSQPoolPolicy,
    MachineLoad,
    PoolThresholds,
    RouteRequest,
)
from services.mesh.registry import ServiceEntry


class NoEngines(LookupError):
    """No ready prompt engine or no ready token engine to place a request on."""


class ClusterScheduler:
    """JSQ placement over the ready engines; thread-safe (reports arrive on the IO thread)."""

    def __init__(self, block_size: int, thresholds: PoolThresholds | None = None) -> None:
        self.block_size = block_size
        self.thresholds = thresholds
        self._lock = threading.Lock()
        self._machine_ids: dict[str, int] = {}  # service id -> machine id, stable for its life
        self._next_id = itertools.count()
        self._engines: dict[int, ServiceEntry] = {}
        self._loads: dict[int, MachineLoad] = {}
        self._policy: JSQPoolPolicy | None = None
        self._req_ids = itertools.count()
        self._linked: dict[int, list[str]] = {}  # each token engine's group, as it last reported

    def set_engines(self, entries: list[ServiceEntry]) -> None:
        """The ready engines now (from the registry); rebuilds the policy if the set changed."""
        with self._lock:
            engines = {self._machine_id(e.service_id): e for e in entries if e.is_engine}
            changed = engines.keys() != self._engines.keys()
            self._engines = engines
            self._loads = {m: self._loads.get(m, MachineLoad(m)) for m in engines}
            if changed:
                homes = {m: Role(e.role) for m, e in engines.items()}
                self._policy = JSQPoolPolicy(homes, self.thresholds) if self._can_split() else None

    def on_load(self, report: LoadReport) -> None:
        """The latest report of one engine replaces the router's estimate of its load."""
        with self._lock:
            machine_id = self._machine_ids.get(report.engine_id)
            if machine_id is None or machine_id not in self._engines:
                return  # not (or no longer) routable
            self._loads[machine_id] = MachineLoad(
                machine_id,
                pending_prompt_tokens=report.pending_prompt_tokens,
                decode_tokens=report.running_decode_tokens,
                free_kv_tokens=report.free_kv_blocks * self.block_size,
            )
            self._linked[machine_id] = report.shard_endpoints

    def can_place(self) -> bool:
        with self._lock:
            return self._policy is not None

    def choose(self, prompt_len: int) -> tuple[ServiceEntry, ServiceEntry]:
        """(prompt engine, token engine) for a new request of `prompt_len` tokens."""
        with self._lock:
            if self._policy is None:
                raise NoEngines("no ready prompt and token engines")
            request = RouteRequest(next(self._req_ids), prompt_len)
            self._policy.rebalance(self._loads, time.monotonic())
            decision = self._policy.route(request, self._loads, time.monotonic())
            prompt_id, token_id = decision.prompt_machine_id, decision.token_machine_id
            self._account(prompt_id, token_id, prompt_len)
            return self._engines[prompt_id], self._linked_group(token_id)

    def loads(self) -> dict[str, MachineLoad]:
        """The current estimate per engine service id (for stats and tests)."""
        with self._lock:
            return {e.service_id: self._loads[m] for m, e in self._engines.items()}

    def _account(self, prompt_id: int, token_id: int, prompt_len: int) -> None:
        # Until the next report: the prompt is pending on one, its KV will decode on the other.
        p = self._loads[prompt_id]
        pending = p.pending_prompt_tokens + prompt_len
        self._loads[prompt_id] = replace(p, pending_prompt_tokens=pending)
        t = self._loads[token_id]
        self._loads[token_id] = replace(t, decode_tokens=t.decode_tokens + prompt_len)

    def _linked_group(self, machine_id: int) -> ServiceEntry:
        """The token engine's entry with the shard group it has linked: its registry entry lags
        behind a lost shard (heartbeat age), its load report does not. A group that differs from
        the entry's is not used: the request decodes with the engine's local attention."""
        entry = self._engines[machine_id]
        linked = self._linked.get(machine_id)
        if linked is None or linked == [s.kv_endpoint for s in entry.shards]:
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
