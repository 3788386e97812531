"""An idle shard sleeps: its link loop and its KV receiver block in epoll until a message or a
hello (`UcxWorker.idle_until`), instead of waking every 100 ms as they did; a message after the
idle spell is answered, a new link accepted, and shutdown noticed at once (it wakes them) rather
than at the end of an idle wait. Real UCX links on loopback."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from common.protocol import KvPages, ShardIngress, ShardLinkMessage
from common.transport import kv_links
from common.transport.kv_links import KvReceiver
from common.transport.ucx_channel import UcxTensorChannel
from common.transport.ucx_listener import UcxListener
from services.shard import worker as shard_worker
from services.shard.worker import IDLE_WAIT_S
from tests.integration.test_link_input import KEY, answers, shard_loop_only
from tests.thread_wakeups import thread_wakeups

IDLE_S = 2.0  # the idle spell measured: two `IDLE_WAIT_S`


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_an_idle_shard_link_loop_and_kv_receiver_sleep_and_still_answer_at_once() -> None:
    listener = UcxListener(ShardLinkMessage, "127.0.0.1", KEY)
    worker = shard_loop_only(listener)
    loop = threading.Thread(target=worker.serve_links, daemon=True)
    loop.start()
    landed = threading.Event()
    receiver = KvReceiver("127.0.0.1", KEY, lambda header, tensors: landed.set())
    try:
        link = UcxTensorChannel.connect(listener.address, ShardLinkMessage, key=KEY)
        assert answers(link, 1)
        kv_link = UcxTensorChannel.connect(receiver.address, ShardIngress, key=KEY)
        time.sleep(0.5)  # past the link's busy spell (`POLL_S`)
        before = thread_wakeups(loop), thread_wakeups(receiver._thread)
        time.sleep(IDLE_S)
        after = thread_wakeups(loop), thread_wakeups(receiver._thread)
        # Once per `IDLE_WAIT_S` (and a clock tick's rounding), where 100 ms sleeps made 20.
        bound = IDLE_S / IDLE_WAIT_S + 2
        assert after[0] - before[0] <= bound and after[1] - before[1] <= bound
        started = time.monotonic()
        assert answers(link, 2)  # the message wakes the loop, not its next timeout
        k = torch.zeros(1, 2, 1, 4)  # [layers, tokens, heads, head_dim]
        kv_link.send(KvPages("r", 0, 1, 2, 0, 1, total_layers=1), [k, k])
        assert landed.wait(10)
        # A hang guard more than a bound: a wake-up lost to the clock would take `IDLE_WAIT_S`.
        assert time.monotonic() - started < 5 * IDLE_WAIT_S
        newer = UcxTensorChannel.connect(listener.address, ShardLinkMessage, key=KEY, timeout=5)
        assert answers(newer, 3)  # a newer link takes over the idle one
        link.close()
        kv_link.close()
        newer.close()
    finally:
        stopping = time.monotonic()
        worker.running = False
        loop.join(timeout=10)
        receiver.close()
        listener.close()
    assert not loop.is_alive() and time.monotonic() - stopping < 3 * IDLE_WAIT_S + 2


LONG_IDLE_S = 600.0  # an idle wait far longer than the check below waits for its end


def test_shutdown_ends_an_idle_link_loop_and_kv_receiver_without_waiting_out_their_idle_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stop wakes the thread sleeping in its listener's epoll (`UcxListener.wake`): with idle
    waits of `LONG_IDLE_S`, both threads end long before one of them would run out, one idle,
    the other with a link that sends nothing. A wake without a stop changes nothing."""
    monkeypatch.setattr(shard_worker, "IDLE_WAIT_S", LONG_IDLE_S)
    monkeypatch.setattr(kv_links, "IDLE_WAIT_S", LONG_IDLE_S)
    listener = UcxListener(ShardLinkMessage, "127.0.0.1", KEY)
    worker = shard_loop_only(listener)
    loop = threading.Thread(target=worker.serve_links, daemon=True)
    loop.start()
    receiver = KvReceiver("127.0.0.1", KEY, lambda header, tensors: None)
    link = UcxTensorChannel.connect(listener.address, ShardLinkMessage, key=KEY)
    assert answers(link, 1)  # the loop serves the link, then idles on it
    time.sleep(0.5)  # past the link's busy spell (`POLL_S`): into its idle wait
    listener.wake()  # a wake without a stop: the loop waits on, and serves the link
    assert answers(link, 2) and loop.is_alive()
    # As a `Shutdown` does (`ShardWorker._on_ingress`), and as `KvReceiver.close` does itself.
    worker.running = False
    listener.wake()
    closing = threading.Thread(target=receiver.close, daemon=True)
    closing.start()
    loop.join(timeout=LONG_IDLE_S / 10)
    closing.join(timeout=LONG_IDLE_S / 10)
    assert not loop.is_alive() and not receiver._thread.is_alive()
    link.close()
    listener.close()
