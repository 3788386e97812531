"""A prompt engine's KV hold for shards to pull (`kv_transfer: pull`): bounded by bytes (what
does not fit is pushed instead), leased (what nobody pulls is freed), whole requests only."""

from __future__ import annotations

import torch

from common.kv_hold import KvHold
from common.protocol import KvPages

LAYERS, TOKENS, HEADS, DIM = 4, 5, 1, 8


def page(req_id: str, layer: int, num_layers: int = 1, heads: tuple[int, int] = (0, 1)):
    header = KvPages(req_id, layer, num_layers, TOKENS, heads[0], heads[1], LAYERS,
                     reserve_tokens=TOKENS + 4)  # fmt: skip
    k = torch.full((num_layers, TOKENS, HEADS, DIM), float(layer))
    return header, k, -k


def test_a_layer_wise_request_is_taken_whole_once_and_in_layer_order():
    hold = KvHold(max_bytes=1 << 20)
    for layer in (0, 2, 1):
        assert hold.put(*page("a", layer))
    assert hold.take("a", 0, 1) == "not complete yet"
    assert not hold.is_complete("a", 0, 1)
    assert hold.put(*page("a", 3))
    assert hold.is_complete("a", 0, 1)
    header, k, v = hold.take("a", 0, 1)
    assert (header.layer_start, header.num_layers, header.reserve_tokens) == (0, 4, TOKENS + 4)
    assert k[:, 0, 0, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert torch.equal(v, -k)
    assert isinstance(hold.take("a", 0, 1), str)  # pulled once: forgotten
    assert hold.num_bytes == 0 and len(hold) == 0


def test_heads_are_held_apart_and_a_miss_says_why():
    hold = KvHold(max_bytes=1 << 20)
    assert hold.put(*page("a", 0, LAYERS, heads=(0, 1)))
    assert "not held" in hold.take("a", 1, 2)
    assert not isinstance(hold.take("a", 0, 1), str)


def test_a_request_that_would_not_fit_is_not_held_at_all():
    """Judged on its first page by its whole size, so none of its pages are held: its sender
    pushes every one (never half held, half pushed)."""
    one_layer = 2 * TOKENS * HEADS * DIM * 4
    hold = KvHold(max_bytes=LAYERS * one_layer + one_layer)  # one request and a bit
    for layer in range(LAYERS):
        assert hold.put(*page("a", layer))
    assert not hold.put(*page("b", 0))
    hold.drop("a")
    assert hold.num_bytes == 0
    assert not hold.put(*page("b", 1))  # still refused: its first page went pushed


def test_what_nobody_pulls_is_freed_after_its_lease():
    now = [0.0]
    hold = KvHold(max_bytes=1 << 20, lease_s=30.0, clock=lambda: now[0])
    assert hold.put(*page("a", 0, LAYERS))
    now[0] = 29.0
    assert hold.expire() == []
    now[0] = 31.0
    assert hold.expire() == [("a", 0, 1)]
    assert hold.num_bytes == 0
    assert "not held" in hold.take("a", 0, 1)
