"""Where a decode group's processes run when the whole mesh shares one host."""

from __future__ import annotations

from services.launch.core_pinning import GroupPlacement, place_decode_groups


def test_each_shard_gets_a_core_and_the_engine_shares_the_last_shards():
    # The engine sends to shard 0 first: it must not share shard 0's core (it would wait for the
    # engine to block), while the last shard runs the moment the engine blocks.
    assert place_decode_groups(1, 2, cores=[0, 1]) == [GroupPlacement((1,), ((0,), (1,)))]


def test_groups_take_cores_round_robin():
    assert place_decode_groups(2, 1, cores=[0, 1]) == [
        GroupPlacement((0,), ((0,),)),
        GroupPlacement((1,), ((1,),)),
    ]
    assert place_decode_groups(2, 2, cores=[4, 5, 6, 7]) == [
        GroupPlacement((5,), ((4,), (5,))),
        GroupPlacement((7,), ((6,), (7,))),
    ]
    # More processes than cores: they share, in order.
    assert place_decode_groups(1, 3, cores=[0, 1]) == [GroupPlacement((0,), ((0,), (1,), (0,)))]


def test_local_attention_engines_get_their_own_cores():
    assert place_decode_groups(2, 0, cores=[0, 1, 2]) == [
        GroupPlacement((0,), ()),
        GroupPlacement((1,), ()),
    ]


def test_an_engine_of_several_threads_gets_a_core_per_thread():
    # Two OpenMP threads held to one core would take turns through every GEMM.
    assert place_decode_groups(1, 2, cores=[0, 1], engine_threads=2) == [
        GroupPlacement((1, 0), ((0,), (1,)))
    ]
    assert place_decode_groups(2, 1, cores=[0, 1, 2, 3], engine_threads=2) == [
        GroupPlacement((0, 1), ((0,),)),
        GroupPlacement((1, 2), ((1,),)),
    ]
    # Local attention: cores of its own, the next group after them; never more than there are.
    assert place_decode_groups(2, 0, cores=[0, 1, 2], engine_threads=2) == [
        GroupPlacement((0, 1), ()),
        GroupPlacement((2, 0), ()),
    ]
    assert place_decode_groups(1, 1, cores=[0, 1], engine_threads=8) == [
        GroupPlacement((0, 1), ((0,),))
    ]


def test_one_core_places_nothing():
    assert place_decode_groups(1, 2, cores=[3]) == [GroupPlacement((), ((), ()))]
    assert place_decode_groups(2, 0, cores=[]) == [GroupPlacement((), ())] * 2
