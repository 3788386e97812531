"""Rebuilding a dead shard's heads (Lamina §5): the rule that chooses rebuild or migration, a
prompt engine's rebuild (the lost heads' KV, as its prefill shipped them; no token out), and a
token engine's parked requests: resumed once rebuilt, migrated (a retryable error) when the
rebuilding prompt engine dies mid-rebuild, or when a second shard dies.

The engines are real `Engine`s wired in-process (their `on_*` inputs and outputs, no sockets);
the shard group is addresses only: no decode step runs against it here (the LocalMesh test in
tests/integration/test_self_healing.py kills a real shard under real streams).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.mesh_options import MeshOptions
from common.protocol import (
    DecodeHandoff,
    GenerateRequest,
    KvRebuilt,
    RebuildKv,
    SamplingSpec,
    ShardAddress,
)
from common.roles import Role
from common.scheduling.shard_rebuild import RebuildChoice, plan_rebuild
from services.engine.engine import Engine
from services.engine.faults import EngineFaults
from tests.conftest import random_prompts

OLD, NEW = ["s0", "s1"], ["s0", "s1.1"]


@pytest.mark.parametrize(
    ("new_group", "head_split", "num_rebuilders", "waited_s", "choice"),
    [
        (NEW, True, 1, 0.0, RebuildChoice.REBUILD),
        ([], True, 1, 1.0, RebuildChoice.WAIT),  # no replacement yet
        ([], True, 1, 5.0, RebuildChoice.MIGRATE),  # none within the bound
        (NEW, True, 0, 0.0, RebuildChoice.MIGRATE),  # no prompt engine to recompute
        (["s0.1", "s1.1"], True, 1, 0.0, RebuildChoice.MIGRATE),  # a survivor died too
        (["s0", "s1", "s2"], True, 1, 0.0, RebuildChoice.MIGRATE),  # another shape
        (OLD, True, 1, 0.0, RebuildChoice.MIGRATE),  # the lost slot kept the dead shard
        (NEW, False, 1, 0.0, RebuildChoice.MIGRATE),  # whole requests per shard
    ],
)
def test_plan_rebuild_rules(
    new_group: list[str], head_split: bool, num_rebuilders: int, waited_s: float,
    choice: RebuildChoice,
) -> None:  # fmt: skip
    plan = plan_rebuild(OLD, frozenset({1}), new_group, head_split=head_split,
                        num_rebuilders=num_rebuilders, waited_s=waited_s, bound_s=5.0)  # fmt: skip
    assert plan.choice is choice
    assert plan.targets == ((1,) if choice is RebuildChoice.REBUILD else ())
    assert bool(plan.reason) == (choice is RebuildChoice.MIGRATE)


def test_a_bound_of_zero_turns_rebuild_off() -> None:
    plan = plan_rebuild(OLD, frozenset({1}), NEW, head_split=True, num_rebuilders=1,
                        waited_s=0.0, bound_s=0.0)  # fmt: skip
    assert plan.choice is RebuildChoice.MIGRATE and "off" in plan.reason


def shard(name: str, slot: int) -> ShardAddress:
    return ShardAddress(f"{name}-kv", slot, slot + 1, service_id=name)


GROUP = [shard("s0", 0), shard("s1", 1)]
REBUILT = [shard("s0", 0), shard("s1.1", 1)]
GREEDY = SamplingSpec(max_tokens=40, temperature=0.0, ignore_eos=True)


def prompt_engine(model_path: Path, shipped: list[tuple]) -> Engine:
    def ship(dest: ShardAddress, pages, k: torch.Tensor, v: torch.Tensor) -> None:  # noqa: ANN001
        shipped.append((dest.service_id, pages, k.clone(), v.clone()))

    options = MeshOptions(num_blocks=256, layer_wise_min_tokens=8)
    return Engine.build("p", Role.PROMPT, options, str(model_path), ship, command_endpoint="p-cmd")


def test_a_rebuild_ships_the_lost_heads_as_the_prefill_did_and_no_token(
    tiny_model_path: Path,
) -> None:
    """A prompt engine asked to rebuild slot 1 computes the request's KV from its tokens and
    ships heads [1, 2) only, to the replacement, equal to what its prefill shipped to the shard
    that died, and answers its token engine; no token goes to any client."""
    shipped: list[tuple] = []
    engine = prompt_engine(tiny_model_path, shipped)
    prompt = random_prompts([30], 2048, seed=7)[0]
    engine.on_generate(GenerateRequest("r", prompt, GREEDY, "router", "t-cmd", "", GROUP))
    first = engine.step()
    [(_, handoff)] = first.handoffs
    original = {p.layer_start: (k, v) for name, p, k, v in shipped if name == "s1"}
    reserved = {p.reserve_tokens for name, p, _, _ in shipped if name == "s1"}
    shipped.clear()
    rebuild = RebuildKv("r", handoff.token_ids[:-1], len(prompt), GREEDY, [REBUILT[1]], "t-cmd")
    assert not engine.on_rebuild(rebuild)
    out = engine.step()
    assert out.outputs == [] and out.handoffs == []
    assert out.rebuilds == [("t-cmd", KvRebuilt("r"))]
    assert {name for name, *_ in shipped} == {"s1.1"}
    assert all((p.head_start, p.head_end) == (1, 2) for _, p, _, _ in shipped)
    assert {p.reserve_tokens for _, p, _, _ in shipped} == reserved  # as its prefill reserved
    for _, pages, k, v in shipped:
        k0, v0 = original[pages.layer_start]
        torch.testing.assert_close((k, v), (k0, v0))
    assert "r" not in engine.table


def parked_token_engine(model_path: Path, num: int = 2) -> tuple[Engine, EngineFaults]:
    """A token engine decoding `num` hand-offs against GROUP, whose shard 1 just died."""
    options = MeshOptions(num_blocks=64, shard_rebuild_wait_s=10.0)
    engine = Engine.build("t", Role.TOKEN, options, str(model_path), lambda *a: None,
                          command_endpoint="t-cmd", shards=GROUP)  # fmt: skip
    for i, prompt in enumerate(random_prompts([12] * num, 2048, seed=3)):
        handoff = DecodeHandoff(f"r{i}", [*prompt, 5], len(prompt), GREEDY, "router", 4, GROUP)
        assert not engine.on_handoff(handoff).outputs
    assert len(engine.admission.sharded) == num
    faults = EngineFaults(engine)
    assert not faults.shard_lost({1}, now=100.0).outputs  # parked, not ended
    assert set(engine.admission.parked) == {f"r{i}" for i in range(num)}
    assert engine.rebuilds.held() == [GROUP[0]]  # the survivor's link stays
    return engine, faults


def test_parked_requests_are_rebuilt_on_the_replacement_then_resume(
    tiny_model_path: Path,
) -> None:
    engine, faults = parked_token_engine(tiny_model_path)
    assert not faults.relink([], [], "no group yet", ["p-cmd"], now=101.0)  # WAIT: nothing ends
    out = faults.relink([], REBUILT, "its shard group changed", ["p-cmd", "p2-cmd"], now=102.0)
    assert not out.outputs
    sent = {m.req_id: (endpoint, m) for endpoint, m in out.rebuilds}
    assert {endpoint for endpoint, _ in sent.values()} == {"p-cmd", "p2-cmd"}  # spread
    for req_id, (_, message) in sent.items():
        assert isinstance(message, RebuildKv)
        tokens = engine.table.requests[req_id].all_token_ids
        assert message.token_ids == tokens[:-1] and message.shards == [REBUILT[1]]
        assert engine.table.routes[req_id].shards == tuple(REBUILT)  # its frees go there now
    assert not faults.kv_rebuilt(KvRebuilt("r0"))
    assert [s.req_id for s in engine.admission.sharded] == ["r0"]
    assert not faults.kv_rebuilt(KvRebuilt("r1"))
    assert engine.rebuilds.lost is None and engine.rebuilds.num_rebuilt == 2


def test_a_rebuilding_prompt_engine_that_dies_leaves_its_requests_to_migration(
    tiny_model_path: Path,
) -> None:
    """No `KvRebuilt` comes (its prompt engine died mid-rebuild): past `shard_rebuild_wait_s`
    each parked request ends with a retryable error (the router re-runs it), and its KV is freed
    on the group it was rebuilt onto."""
    engine, faults = parked_token_engine(tiny_model_path)
    faults.relink([], REBUILT, "its shard group changed", ["p-cmd"], now=101.0)
    assert not faults.expire(105.0).outputs  # within the bound (the loss was at 100.0)
    out = faults.expire(110.0)
    assert sorted(o.req_id for _, o in out.outputs) == ["r0", "r1"]
    assert all(o.finish_reason == "error" and o.retryable for _, o in out.outputs)
    assert {endpoint for endpoint, _ in out.frees} == {"s0-kv", "s1.1-kv"}
    assert not engine.admission.parked and engine.rebuilds.num_fallbacks == 2
    assert not faults.kv_rebuilt(KvRebuilt("r0"))  # late: ignored


def test_a_second_shard_death_during_a_rebuild_migrates_the_group(tiny_model_path: Path) -> None:
    """The replacement (or a survivor) dies while a rebuild is under way: the resumed requests
    and the parked ones all end retryably."""
    engine, faults = parked_token_engine(tiny_model_path)
    faults.relink([], REBUILT, "its shard group changed", ["p-cmd"], now=101.0)
    faults.kv_rebuilt(KvRebuilt("r0"))
    out = faults.shard_lost({1}, now=101.0)
    assert sorted(o.req_id for _, o in out.outputs) == ["r0", "r1"]
    assert all(o.retryable for _, o in out.outputs)
    assert not engine.admission.sharded and not engine.admission.parked
    assert engine.rebuilds.lost is None
