"""Pools as the engines' state: an engine's role lease (common/scheduling/role_lease.py) and the
routers' view of the pools from load reports (services/router/pool_state.py, cluster_scheduler).

Hand-built states: a borrow is asked as a `SetRole` and becomes state only when the engine
reports it; every router reading the same reports sees the same pools; a drained engine is sent
home; a loan that is not renewed runs out on the engine by itself.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from common.protocol import LoadReport, SetRole
from common.roles import Role
from common.scheduling.cluster import PoolThresholds
from common.scheduling.home_roles import HomeRoleThresholds
from common.scheduling.role_lease import RoleLease
from services.mesh.registry import ServiceEntry
from services.router.cluster_scheduler import ClusterScheduler

LEASE_S = 3.0
THRESHOLDS = PoolThresholds(prompt_tokens=300, role_lease_s=LEASE_S)


def engine(service_id: str, role: Role) -> ServiceEntry:
    return ServiceEntry(role=role, service_id=service_id, state="ready",
                        command_endpoint=f"tcp://{service_id}")  # fmt: skip


ENGINES = [engine("p0", Role.PROMPT), engine("t0", Role.TOKEN), engine("t1", Role.TOKEN)]


def report(
    engine_id: str, role: Role, home: Role, pending: int = 0, decode: int = 0, received: int = 0
) -> LoadReport:
    """A report made after the engine had received `received` of the router's requests."""
    return LoadReport(engine_id, role.value, pending, decode, 0, 0, 1000, home_role=home.value,
                      received_requests={"": received})  # fmt: skip


def router(*reports: LoadReport) -> ClusterScheduler:
    scheduler = ClusterScheduler(block_size=16, thresholds=THRESHOLDS)
    scheduler.set_engines(ENGINES)
    for r in reports:
        scheduler.on_load(r)
    return scheduler


def changes(scheduler: ClusterScheduler) -> list[tuple[str, SetRole]]:
    return [(e.service_id, msg) for e, msg in scheduler.take_role_changes()]


# -- the engine's lease ---------------------------------------------------------------------------


def test_a_lent_engine_serves_mixed_until_its_lease_runs_out() -> None:
    lease = RoleLease(Role.TOKEN)
    assert lease.current(0.0) == Role.TOKEN
    lease.set(Role.MIXED, 2.0, now=10.0)
    assert lease.current(11.9) == Role.MIXED
    lease.set(Role.MIXED, 2.0, now=11.0)  # renewed: runs to 13.0 now
    assert lease.current(12.5) == Role.MIXED
    assert lease.current(13.0) == Role.TOKEN  # no renewal: home by itself
    assert lease.current(20.0) == Role.TOKEN
    assert lease.num_loans == 1  # a renewal is the same loan
    lease.set(Role.MIXED, 2.0, now=21.0)
    assert lease.num_loans == 2


def test_set_role_home_returns_at_once_and_is_idempotent() -> None:
    lease = RoleLease(Role.PROMPT)
    lease.set(Role.MIXED, 5.0, now=0.0)
    lease.set(Role.PROMPT, 0.0, now=1.0)
    lease.set(Role.PROMPT, 0.0, now=1.0)
    assert lease.current(1.0) == Role.PROMPT


def test_a_role_outside_home_and_mixed_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot serve as token"):
        RoleLease(Role.PROMPT).set(Role.TOKEN, 5.0, now=0.0)
    with pytest.raises(ValueError, match="positive lease"):
        RoleLease(Role.TOKEN).set(Role.MIXED, 0.0, now=0.0)
    with pytest.raises(ValueError):
        RoleLease(Role.MIXED).set(Role.PROMPT, 5.0, now=0.0)  # a baseline engine stays mixed


# -- the routers' view ----------------------------------------------------------------------------


def full_prompt_pool() -> list[LoadReport]:
    """p0 past its threshold; t0 busy decoding, t1 idle: t1 is the one to lend."""
    return [
        report("p0", Role.PROMPT, Role.PROMPT, pending=290),
        report("t0", Role.TOKEN, Role.TOKEN, decode=500),
        report("t1", Role.TOKEN, Role.TOKEN),
    ]


def test_a_borrow_is_a_set_role_and_state_only_once_the_engine_reports_it() -> None:
    scheduler = router(*full_prompt_pool())
    prompt, _ = scheduler.choose(100)
    assert prompt.service_id == "t1"
    assert changes(scheduler) == [("t1", SetRole("mixed", LEASE_S))]
    # Another router, same reports, before t1 has said anything: t1 is in the token pool still.
    other = router(*full_prompt_pool())
    assert other.pools()["t1"] == "token"
    # t1 reports itself mixed: every router sees it so.
    for r in (scheduler, other):
        r.on_load(report("t1", Role.MIXED, Role.TOKEN, pending=100))
        assert r.pools() == {"p0": "prompt", "t0": "token", "t1": "mixed"}


def test_a_drained_lent_engine_is_sent_home_by_every_router_alike() -> None:
    routers = [router(*full_prompt_pool()) for _ in range(2)]
    for r in routers:
        r.on_load(report("t1", Role.MIXED, Role.TOKEN, pending=0))  # its prompts are done
        r.on_load(report("t1", Role.MIXED, Role.TOKEN, pending=0))  # ... said twice: drained
        r.rebalance()
        assert changes(r) == [("t1", SetRole("token"))]  # both ask the same: they converge
        r.on_load(report("t1", Role.TOKEN, Role.TOKEN))
        assert r.pools()["t1"] == "token"
        r.rebalance()
        assert changes(r) == []  # home and reported home: nothing more to ask


def test_a_report_older_than_the_borrowed_work_does_not_send_the_engine_home() -> None:
    # The router lends t1 and places a prompt on it. t1's next reports may have been made before
    # the prompt reached it: the one from before the loan (token, nothing pending), then its
    # first as mixed. Neither shows the prompt, so neither may send t1 home; the one after does.
    scheduler = router(*full_prompt_pool())
    prompt, _ = scheduler.choose(100)
    assert prompt.service_id == "t1"
    assert changes(scheduler) == [("t1", SetRole("mixed", LEASE_S))]
    for stale in (report("t1", Role.TOKEN, Role.TOKEN), report("t1", Role.MIXED, Role.TOKEN)):
        scheduler.on_load(stale)
        scheduler.rebalance()
        assert changes(scheduler) == []
        assert scheduler.pools()["t1"] == "mixed"
    # Made after the prompt came and went: drained.
    scheduler.on_load(report("t1", Role.MIXED, Role.TOKEN, received=1))
    scheduler.rebalance()
    assert changes(scheduler) == [("t1", SetRole("token"))]


def test_an_engine_that_leaves_and_comes_back_counts_its_mixed_reports_again() -> None:
    scheduler = router(*full_prompt_pool())
    scheduler.on_load(report("t1", Role.MIXED, Role.TOKEN))
    scheduler.set_engines([e for e in ENGINES if e.service_id != "t1"])  # gone (killed)
    scheduler.set_engines(ENGINES)  # back, with the same id
    scheduler.on_load(report("t1", Role.MIXED, Role.TOKEN))  # its first since it came back
    scheduler.rebalance()
    assert ("t1", SetRole("token")) not in changes(scheduler)  # kept (and its lease renewed)
    scheduler.on_load(report("t1", Role.MIXED, Role.TOKEN))
    scheduler.rebalance()
    assert changes(scheduler) == [("t1", SetRole("token"))]


def test_a_report_with_an_unknown_pool_is_ignored_not_fatal() -> None:
    scheduler = router(*full_prompt_pool())
    scheduler.on_load(LoadReport("t1", "bogus", 0, 0, 0, 0, 1000, home_role="token"))
    scheduler.on_load(LoadReport("t0", "mixed", 0, 0, 0, 0, 1000, home_role="nonsense"))
    assert scheduler.pools() == {"p0": "prompt", "t0": "token", "t1": "token"}
    scheduler.rebalance()
    assert changes(scheduler) == []


def test_a_lent_engine_with_borrowed_work_has_its_lease_renewed() -> None:
    scheduler = router(*full_prompt_pool())
    scheduler.on_load(report("t1", Role.MIXED, Role.TOKEN, pending=100))
    scheduler.rebalance()
    assert changes(scheduler) == [("t1", SetRole("mixed", LEASE_S))]
    scheduler.rebalance()
    assert changes(scheduler) == []  # renewed a moment ago: not before a third of the lease


def test_pools_survive_a_membership_change() -> None:
    scheduler = router(*full_prompt_pool())
    scheduler.on_load(report("t1", Role.MIXED, Role.TOKEN, pending=100))
    scheduler.set_engines([*ENGINES, engine("t2", Role.TOKEN)])  # the policy is rebuilt
    assert scheduler.pools()["t1"] == "mixed"  # from t1's report, not reset to its home
    assert scheduler.pools()["t2"] == "token"


def test_a_router_that_restarts_learns_the_pools_from_the_reports() -> None:
    # The router that borrowed t1 is gone; a fresh one sees t1 mixed with prompts pending and
    # keeps renewing it, then returns it once drained (or t1's lease returns it alone).
    fresh = router(*full_prompt_pool(), report("t1", Role.MIXED, Role.TOKEN, pending=100))
    fresh.rebalance()
    assert changes(fresh) == [("t1", SetRole("mixed", LEASE_S))]


def test_token_fullness_is_the_kv_where_the_request_would_decode() -> None:
    # t0 and t1 report their shard groups' free blocks: too few for a 100-token prompt on both,
    # so the prompt engine is lent to decode (there are two prompt engines to lend from).
    scheduler = ClusterScheduler(block_size=16, thresholds=THRESHOLDS)
    scheduler.set_engines([*ENGINES, engine("p1", Role.PROMPT)])
    for r in (
        report("p0", Role.PROMPT, Role.PROMPT),
        report("p1", Role.PROMPT, Role.PROMPT, pending=50),
        LoadReport("t0", "token", 0, 0, 0, 0, free_kv_blocks=2, home_role="token"),
        LoadReport("t1", "token", 0, 0, 0, 0, free_kv_blocks=3, home_role="token"),
    ):
        scheduler.on_load(r)
    _, token = scheduler.choose(100)
    assert token.service_id == "p0"
    assert changes(scheduler) == [("p0", SetRole("mixed", LEASE_S))]


def test_thresholds_come_from_the_serve_config() -> None:
    from services.app import AppArgs

    args = AppArgs.model_validate(
        {"topology": "mesh", "mesh": {"pools": {"prompt_tokens": 300, "lease_s": 2.5}}}
    )
    assert args.mesh.pools.thresholds() == PoolThresholds(prompt_tokens=300, role_lease_s=2.5)
    with pytest.raises(ValueError):
        AppArgs.model_validate({"mesh": {"pools": {"lease_s": 0}}})


# -- home moves (common/scheduling/home_roles.py) -------------------------------------------------


def test_a_home_move_ends_a_loan_and_is_counted() -> None:
    lease = RoleLease(Role.TOKEN)
    lease.set(Role.MIXED, 5.0, now=0.0)
    lease.rehome(Role.PROMPT)
    assert (lease.home, lease.current(1.0), lease.num_home_moves) == (Role.PROMPT, Role.PROMPT, 1)
    lease.rehome(Role.PROMPT)  # idempotent
    lease.set(Role.MIXED, 5.0, now=2.0)  # lendable from its new home
    assert lease.current(3.0) == Role.MIXED and lease.num_home_moves == 1
    with pytest.raises(ValueError):
        lease.rehome(Role.SHARD)


def test_the_router_asks_a_home_move_and_assumes_it_until_the_engine_reports() -> None:
    homes = HomeRoleThresholds(hold_s=0.0, cooldown_s=600.0)
    scheduler = ClusterScheduler(16, replace(THRESHOLDS, home_roles=homes))
    scheduler.set_engines(ENGINES)
    for r in (report("p0", Role.PROMPT, Role.PROMPT, pending=1000),
              report("t0", Role.TOKEN, Role.TOKEN, decode=50),
              report("t1", Role.TOKEN, Role.TOKEN)):  # fmt: skip
        scheduler.on_load(r)
    scheduler.rebalance()
    # The prompt side is far fuller: the token engine decoding least moves one step (to mixed).
    assert changes(scheduler) == [("t1", SetRole(Role.MIXED, 0.0, home=Role.MIXED))]
    assert scheduler.pools()["t1"] == "mixed"  # assumed before its report says so
    scheduler.rebalance()
    assert changes(scheduler) == []  # one move per cool-down
    scheduler.on_load(report("t1", Role.MIXED, Role.MIXED))
    assert scheduler.pools() == {"p0": "prompt", "t0": "token", "t1": "mixed"}


def test_home_roles_come_from_the_serve_config() -> None:
    from services.app import AppArgs

    homes = {"shift": 0.4, "settle": 0.05, "hold_s": 20, "cooldown_s": 90}
    args = AppArgs.model_validate({"topology": "mesh", "mesh": {"pools": {"home_roles": homes}}})
    assert args.mesh.pools.thresholds().home_roles == HomeRoleThresholds(0.4, 0.05, 20.0, 90.0)
    assert AppArgs.model_validate({}).mesh.pools.thresholds().home_roles is None  # off
    with pytest.raises(ValueError, match="hysteresis"):  # settle must stay below shift
        AppArgs.model_validate({"mesh": {"pools": {"home_roles": {"shift": 0.1, "settle": 0.2}}}})
