"""A token engine's links to its shard group at start (`EngineWorker._link_at_start`), over real
UCX, against each way a shard can fail it: one that answers late is tried again (with a real mesh:
tests/integration/test_no_hangs.py), one that never answers (stopped, or holding another mesh's
key) ends the start at the deadline and not before, and one that is gone (its process killed) or
an address that is not one ends it at once. A start that fails closes the links it had made."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from common.mesh_options import MeshOptions
from common.protocol import ShardAddress, ShardLinkMessage
from common.transport.ucx_channel import ChannelClosed, UcxTensorChannel
from common.transport.ucx_listener import UcxListener
from common.worker_config import WorkerConfig
from services.engine import worker as worker_module
from services.engine.worker import EngineWorker
from tests.integration.test_link_input import KEY, serving_shard

TRY_S = 0.3  # one try at a link
DEADLINE_S = 1.2  # the start's


class LinkingEngine:
    """An `EngineWorker`'s start-up linking alone, counting its tries and the links it closes."""

    def __init__(self) -> None:
        self.worker = EngineWorker.__new__(EngineWorker)
        self.worker.cfg = WorkerConfig(service_id="token-0", model_path="", ready_endpoint="",
                                       mesh_key=KEY.hex(),
                                       options=MeshOptions(shard_link_timeout_s=TRY_S))  # fmt: skip
        self.tries: list[str] = []
        self.closed: list[str] = []
        self._connect = self.worker._connect
        self.worker._connect = self._counted  # type: ignore[method-assign]

    def _counted(self, shard: ShardAddress) -> UcxTensorChannel[ShardLinkMessage]:
        self.tries.append(shard.service_id)
        link = self._connect(shard)
        close = link.close

        def counted_close() -> None:
            self.closed.append(shard.service_id)
            close()

        link.close = counted_close  # type: ignore[method-assign]
        return link

    def link(self, *shards: ShardAddress) -> dict[str, UcxTensorChannel[ShardLinkMessage]]:
        return self.worker._link_at_start(list(shards))


def shard_at(service_id: str, link_address: str) -> ShardAddress:
    return ShardAddress("", 0, 1, link_address=link_address, service_id=service_id)


@pytest.fixture(autouse=True)
def short_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_module, "SHARD_LINK_START_DEADLINE_S", DEADLINE_S)


def test_a_shard_that_never_answers_ends_the_start_at_its_deadline() -> None:
    """A silent shard (a listener that never accepts: stopped, or another mesh's key): tried
    again until the deadline, then ChannelClosed; the live shard's link made before it is closed,
    and the live shard serves the next engine that links."""
    silent = UcxListener(ShardLinkMessage, "127.0.0.1", KEY)  # never accepts
    engine = LinkingEngine()
    with serving_shard() as live:
        started = time.monotonic()
        with pytest.raises(ChannelClosed, match="did not accept"):
            engine.link(shard_at("shard-0", live), shard_at("shard-1", silent.address))
        took = time.monotonic() - started
        assert DEADLINE_S <= took < DEADLINE_S + TRY_S + 5.0  # the last try, and CI's slack
        assert engine.tries[0] == "shard-0" and engine.tries.count("shard-1") >= 3
        assert engine.closed == ["shard-0"]
        # The live shard was not harmed: the next engine links to it at once.
        next_engine = LinkingEngine()
        links = next_engine.link(shard_at("shard-0", live))
        assert next_engine.tries == ["shard-0"]
        links[live].close()
    silent.close()


def test_a_shard_answering_after_a_failed_try_is_linked_on_the_next() -> None:
    """The listener accepts nothing for the first two tries, then serves: one link, no error."""
    listener = UcxListener(ShardLinkMessage, "127.0.0.1", KEY)
    engine = LinkingEngine()
    accepted: list[UcxTensorChannel[Any]] = []

    def late_accept() -> None:
        # NOTE: accepts once the third try has begun (two given up), whatever the machine's
        # speed: the tries, not the clock, say when.
        while len(engine.tries) < 3:
            time.sleep(0.01)
        end = time.monotonic() + DEADLINE_S
        while time.monotonic() < end:
            try:
                accepted.append(listener.accept(timeout=0.1))
            except TimeoutError:
                pass

    thread = threading.Thread(target=late_accept, daemon=True)
    thread.start()
    links = engine.link(shard_at("shard-0", listener.address))
    thread.join(timeout=10)
    assert list(links) == [listener.address]
    assert len(engine.tries) >= 3 and engine.closed == []
    assert accepted  # the hellos of tries given up are dropped or replaced (newest link wins)
    links[listener.address].close()
    listener.close()


def _listen_then_wait(addresses: Any) -> None:
    listener = UcxListener(ShardLinkMessage, "127.0.0.1", KEY)
    addresses.put(listener.address)
    time.sleep(120)


@contextmanager
def killed_shard_address() -> Iterator[str]:
    """The link address of a shard whose process was killed (SIGKILL) after it published it."""
    context = multiprocessing.get_context("spawn")
    addresses = context.Queue()
    process = context.Process(target=_listen_then_wait, args=(addresses,), daemon=True)
    process.start()
    try:
        address = addresses.get(timeout=60)
        process.kill()
        process.join(timeout=10)
        yield address
    finally:
        process.kill()


def test_a_killed_shard_or_a_garbage_address_ends_the_start_at_once() -> None:
    """Gone is not late: an unreachable shard is not tried until the deadline, and an address
    that is not one fails as it is read. Either way the links already made are closed."""
    with killed_shard_address() as dead, serving_shard() as live:
        for bad in (dead, "not a UCX address", ""):
            engine = LinkingEngine()
            started = time.monotonic()
            with pytest.raises(Exception) as raised:
                engine.link(shard_at("shard-0", live), shard_at("shard-1", bad))
            assert not isinstance(raised.value, ChannelClosed), bad  # not a timeout
            assert time.monotonic() - started < DEADLINE_S, bad
            assert engine.tries == ["shard-0", "shard-1"], bad
            assert engine.closed == ["shard-0"], bad
