"""`HomeRolePolicy` on recorded load series: a lasting prompt-heavy phase moves one token engine's
home toward prompt, a brief one moves none, it moves back once the mix settles, an oscillating
series moves nothing, and no move leaves the cluster without a prompt- or token-capable engine."""

from __future__ import annotations

import pytest

from common.roles import Role
from common.scheduling.cluster import PoolMove, PoolThresholds
from common.scheduling.home_roles import HomeRolePolicy, HomeRoleThresholds
from common.scheduling.load_board import MachineLoad

P, T, M = Role.PROMPT, Role.TOKEN, Role.MIXED
# A prompt engine is full at 1000 pending tokens; each token engine holds 10000 KV tokens.
THRESHOLDS = HomeRoleThresholds(shift=0.5, settle=0.1, hold_s=10.0, cooldown_s=30.0)
POOLS = PoolThresholds(prompt_tokens=1000, home_roles=THRESHOLDS)
KV_TOKENS = 10_000
QUIET = (0, 500)  # (pending prompt tokens, decode tokens per token engine): gap -0.05
BURST = (3000, 500)  # prompt fill 3.0 against decode fill 0.05: gap 2.95


def loads_of(homes: dict[int, Role], pending: int, decode: int) -> dict[int, MachineLoad]:
    """`pending` prompt tokens on the prompt-capable engines, `decode` on each token engine."""
    prompt_ids = [m for m, h in homes.items() if h != T]
    loads = {}
    for m, home in homes.items():
        own_decode = decode if home != P else 0
        loads[m] = MachineLoad(m, pending // len(prompt_ids) if home != T else 0, own_decode,
                               free_kv_tokens=KV_TOKENS - own_decode)  # fmt: skip
    return loads


def replay(
    deployed: dict[int, Role],
    series: list[tuple[float, tuple[int, int]]],
    until: float,
) -> tuple[dict[int, Role], list[tuple[float, PoolMove]]]:
    """Feed the policy one sample a second: `series` is [(from when, (pending, decode))]; each
    move is applied to the homes it sees next. The homes at the end, and every move."""
    policy = HomeRolePolicy(POOLS, deployed)
    homes, moves = dict(deployed), []
    for now in range(int(until)):
        level = [lv for start, lv in series if start <= now][-1]
        for move in policy.observe(homes, loads_of(homes, *level), float(now)):
            homes[move.machine_id] = move.to_pool
            moves.append((float(now), move))
    return homes, moves


ONE_P_TWO_T = {0: P, 1: T, 2: T}


def test_a_lasting_prompt_burst_moves_one_token_engine_and_a_brief_one_none() -> None:
    # Past hold_s, within one cool-down: one token engine's home goes one step toward prompt.
    homes, moves = replay(ONE_P_TWO_T, [(0, QUIET), (5, BURST)], until=40)
    assert [(m.machine_id, m.to_pool) for _, m in moves] == [(1, M)]
    assert 15 <= moves[0][0] <= 17  # the shift held for hold_s (sampled every hold_s / 8)
    assert homes == {0: P, 1: M, 2: T}
    # A burst shorter than hold_s moves nothing.
    _, moves = replay(ONE_P_TWO_T, [(0, QUIET), (5, BURST), (12, QUIET)], until=200)
    assert moves == []


def test_a_burst_that_lasts_moves_one_step_per_cooldown_and_keeps_a_token_engine() -> None:
    homes, moves = replay(ONE_P_TWO_T, [(0, BURST)], until=400)
    # token -> mixed, then -> prompt (the mixed engine decodes less than the other token engine);
    # the last token-capable engine stays.
    steps = [(m.machine_id, m.to_pool) for _, m in moves]
    assert steps[:2] in ([(1, M), (1, P)], [(1, M), (2, M)])
    times = [t for t, _ in moves]
    assert all(b - a >= THRESHOLDS.cooldown_s for a, b in zip(times, times[1:], strict=False))
    assert any(h in (T, M) for h in homes.values()) and any(h in (P, M) for h in homes.values())


def test_it_moves_back_after_the_burst_ends() -> None:
    homes, moves = replay(ONE_P_TWO_T, [(0, QUIET), (5, BURST), (40, QUIET)], until=200)
    assert [(m.machine_id, m.to_pool) for _, m in moves] == [(1, M), (1, T)]
    # Back only after the mix settled for hold_s and a cool-down since the first move.
    assert moves[1][0] >= max(40 + THRESHOLDS.hold_s, moves[0][0] + THRESHOLDS.cooldown_s)
    assert homes == ONE_P_TWO_T


def test_an_oscillating_mix_moves_nothing_and_the_band_between_keeps_a_move() -> None:
    # Shifted and settled by turns, each shorter than hold_s: no hold completes.
    flip = [(float(t), BURST if (t // 6) % 2 else QUIET) for t in range(0, 600, 6)]
    _, moves = replay(ONE_P_TWO_T, flip, until=600)
    assert moves == []
    # After one move, a mix between settle and shift (gap 0.3) neither moves on nor back.
    band = (500, 2000)
    homes, moves = replay(ONE_P_TWO_T, [(0, BURST), (20, band)], until=400)
    assert [(m.machine_id, m.to_pool) for _, m in moves] == [(1, M)]
    assert homes == {0: P, 1: M, 2: T}


def test_never_the_last_token_capable_engine() -> None:
    # One prompt and one token engine: the token engine may become mixed (still decodes), never
    # a prompt engine.
    homes, moves = replay({0: P, 1: T}, [(0, BURST)], until=400)
    assert [(m.machine_id, m.to_pool) for _, m in moves] == [(1, M)]
    assert homes == {0: P, 1: M}


def test_a_decode_heavy_mix_moves_a_prompt_engine_toward_token() -> None:
    full = (0, 9000)  # decode fill 0.9, nothing pending
    homes, moves = replay({0: P, 1: P, 2: T}, [(0, full)], until=40)
    assert [(m.machine_id, m.to_pool) for _, m in moves] == [(0, M)]
    assert homes == {0: M, 1: P, 2: T}


def test_a_prompt_only_engine_never_gets_a_token_capable_home() -> None:
    # The live mesh's prompt engines receive no KV: a decode-heavy mix moves none of them.
    policy = HomeRolePolicy(POOLS, {0: P, 1: P, 2: T}, prompt_only={0, 1})
    homes = {0: P, 1: P, 2: T}
    for now in range(200):
        assert policy.observe(homes, loads_of(homes, 0, 9000), float(now)) == []


def test_a_move_seen_in_the_homes_starts_the_cooldown() -> None:
    # Another router replica moved engine 1 at t=5, before this one's hold ran out: this one
    # waits a cool-down from then.
    policy = HomeRolePolicy(POOLS, ONE_P_TWO_T)
    homes = dict(ONE_P_TWO_T)
    moved_at = []
    for now in range(0, 120):
        if now == 5:
            homes[1] = M
        for move in policy.observe(homes, loads_of(homes, *BURST), float(now)):
            homes[move.machine_id] = move.to_pool
            moved_at.append(now)
    assert moved_at and moved_at[0] >= 5 + THRESHOLDS.cooldown_s


def test_thresholds_need_hysteresis() -> None:
    with pytest.raises(ValueError, match="hysteresis"):
        HomeRoleThresholds(shift=0.2, settle=0.2)
