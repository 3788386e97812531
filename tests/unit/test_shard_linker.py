"""`ShardLinker` (services/engine/shard_linker.py): links connected on threads of their own, tried
again while wanted, handed over through a descriptor the loop polls; a link made for an address
no longer wanted is closed, never handed over. The connect here is a function that fails a given
number of times first (a shard that does not answer yet); real UCX links are
tests/integration/test_relinks.py's."""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Iterator

import pytest

from common.protocol import ShardAddress
from services.engine.shard_linker import ShardLinker


class Link:
    def __init__(self, address: str) -> None:
        self.address = address
        self.closed = False

    def close(self) -> None:
        self.closed = True


class Connects:
    """Fails each address `failures[address]` times, then links; `release` gates every try."""

    def __init__(self, failures: dict[str, int]) -> None:
        self.failures = dict(failures)
        self.release = threading.Event()
        self.release.set()
        self.made: list[Link] = []

    def __call__(self, shard: ShardAddress) -> Link:
        self.release.wait(10)
        if self.failures.get(shard.link_address, 0) > 0:
            self.failures[shard.link_address] -= 1
            raise ConnectionError("not answering yet")
        link = Link(shard.link_address)
        self.made.append(link)
        return link


def shard(address: str) -> ShardAddress:
    return ShardAddress(f"tcp://{address}", 0, 1, link_address=address)


def take(linker: ShardLinker, count: int) -> list[tuple[str, object]]:
    """What the loop would take once woken, until `count` links came (each wait bounded)."""
    got: list[tuple[str, object]] = []
    while len(got) < count:
        readable, _, _ = select.select([linker.fileno()], [], [], 10)
        assert readable, f"{len(got)} of {count} links came"
        got += linker.ready()
    return got


@pytest.fixture
def connects() -> Iterator[Connects]:
    yield Connects({"b": 2})


def test_wanted_links_come_through_the_descriptor_after_retries(connects: Connects) -> None:
    linker = ShardLinker(connects, retry_s=0.01, retry_max_s=0.02)
    linker.want([shard("a"), shard("b")])  # "b" fails twice first
    got = dict(take(linker, 2))
    assert sorted(got) == ["a", "b"] and not any(link.closed for link in connects.made)
    assert linker.connecting() == set()
    linker.close()


def test_a_link_no_longer_wanted_is_closed_not_handed_over(connects: Connects) -> None:
    linker = ShardLinker(connects, retry_s=0.01, retry_max_s=0.02)
    connects.release.clear()  # both tries in flight
    linker.want([shard("a"), shard("c")])
    linker.want([shard("c")])  # the group changed: "a" is given up
    connects.release.set()
    assert [address for address, _ in take(linker, 1)] == ["c"]
    # "a"'s try was under way when it was given up: the link it made is closed by the loop.
    deadline = time.monotonic() + 10
    while not any(link.address == "a" and link.closed for link in connects.made):
        assert time.monotonic() < deadline, "a link made for a given-up address stayed open"
        select.select([linker.fileno()], [], [], 0.1)
        assert linker.ready() == []
    linker.close()
