"""`LoadBoard` against a scan: the least-loaded member of a pool, found in its lazy heaps, is the
one `shortest` finds over fabricated reports, through rises, falls, moves and prefix credits."""

import random

import pytest

from common.roles import Role
from common.scheduling.cluster import (
    FIGURE_KEYS,
    JSQPoolPolicy,
    PoolMove,
    PoolTable,
    RouteRequest,
    prefix_credited,
    shortest,
)
from common.scheduling.load_board import LoadBoard

P, T, M = Role.PROMPT, Role.TOKEN, Role.MIXED


def test_the_least_is_the_scans_through_reports_and_moves() -> None:
    rng = random.Random(3)
    homes = {i: P if i < 12 else T for i in range(30)}
    pools = PoolTable(homes)
    board = LoadBoard(pools)
    for i in homes:
        board.report(i, rng.randrange(50), rng.randrange(50), 10**6)
    for step in range(3000):
        machine = rng.randrange(30)
        pending, decode = board[machine].pending_prompt_tokens, board[machine].decode_tokens
        # Small moves up and down, so that ties (broken by the lowest id) are frequent.
        board.report(machine, max(0, pending + rng.randint(-5, 5)),
                     max(0, decode + rng.randint(-5, 5)), 10**6)  # fmt: skip
        if step % 97 == 0:  # a machine lent to the mixed pool, or sent home
            lent = rng.randrange(30)
            pools.apply(PoolMove(lent, M if pools.current[lent] != M else homes[lent]), step)
        pool, figure = rng.choice([P, T, M]), rng.randrange(3)
        credit = {m: rng.randrange(20) for m in rng.sample(range(30), 4)} if step % 3 else {}
        request = RouteRequest(0, 100, credit)
        key = prefix_credited(FIGURE_KEYS[figure], request, 0.5)
        expected = shortest(pools.members(pool), board, key)
        assert board.least(pool, figure, credit, 0.5) == expected, step


def test_jsq_routes_the_same_over_a_board_as_over_a_dict() -> None:
    homes = {0: P, 1: P, 2: T, 3: T}
    with_dict, with_board = (JSQPoolPolicy(homes) for _ in range(2))
    board = LoadBoard(with_board.pools)
    rows = [(900, 0), (100, 0), (0, 5000), (0, 3000)]
    for i, (pending, decode) in enumerate(rows):
        board.report(i, pending, decode, 10**6)
    state = {i: board[i] for i in homes}
    request = RouteRequest(1, 500, {0: 900})
    with_dict.prefix_weight = with_board.prefix_weight = 1.0
    assert with_board.route(request, board, 0.0) == with_dict.route(request, state, 0.0)
    assert with_board.route(request, board, 0.0).prompt_machine_id == 0  # credited: 900 - 900


def test_a_negative_machine_id_is_refused() -> None:
    """Entries pack (figure, id) into one int, which orders as the pair only for ids from 0."""
    with pytest.raises(ValueError, match="machine ids"):
        LoadBoard(PoolTable({-1: P, 0: T}))
