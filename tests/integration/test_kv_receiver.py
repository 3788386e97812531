"""A KV receiver (`common/transport/kv_links.py`) serves every sender's link on one thread: a sender
stopped in the middle of a large message (its header landed, its tensors did not) costs its own
link only. Another sender's KV lands meanwhile, and the stopped one's link is dropped after
`PAYLOAD_TIMEOUT_S` (before, the thread waited out the tensors for 30 s, every sender with it).
Real processes and UCX links; the stopped sender stops itself (SIGSTOP) right after posting."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
from typing import Any

import torch

from common.protocol import KvPages, ShardIngress
from common.transport.kv_links import PAYLOAD_TIMEOUT_S, KvReceiver, KvSender
from common.transport.ucx_channel import UcxTensorChannel

PEERS = mp.get_context("forkserver")
KEY = bytes(range(32))
HOST = "127.0.0.1"


def pages(req_id: str, num_tokens: int) -> tuple[KvPages, torch.Tensor, torch.Tensor]:
    k = torch.full((1, num_tokens, 2, 64), 1.5)  # [layers, tokens, heads, head_dim]
    return KvPages(req_id, 0, 1, num_tokens, 0, 2, 1), k, k.clone()


def stop_mid_message(address: str, sent: Any) -> None:
    """A prompt engine that stops (SIGSTOP) while its message's tensors are in flight."""
    link = UcxTensorChannel.connect(address, ShardIngress, 10.0, HOST, KEY)
    header, k, v = pages("whole", 4)
    link.send(header, [k, v])  # the link works
    header, k, v = pages("half", 64 * 1024)  # 32 MiB per tensor: zero-copy, after the header
    link.send_async(header, [k, v])
    for _ in range(20):  # the header leaves; the tensors need this process to progress
        link._worker.worker.progress()  # noqa: SLF001 - a sender that stops right here
    sent.send("posted")  # a pipe: written before this process stops (a Queue's thread may not)
    os.kill(os.getpid(), signal.SIGSTOP)


def test_a_sender_stopped_mid_message_holds_no_other_senders_kv() -> None:
    landed: queue.SimpleQueue[tuple[str, float]] = queue.SimpleQueue()
    receiver = KvReceiver(HOST, KEY, lambda h, t: landed.put((h.req_id, time.monotonic())))
    told, sent = PEERS.Pipe(duplex=False)
    stopped = PEERS.Process(target=stop_mid_message, args=(receiver.address, sent), daemon=True)
    stopped.start()
    sender = KvSender(HOST, KEY)
    try:
        assert told.poll(60) and told.recv() == "posted"
        assert landed.get(timeout=30)[0] == "whole"
        time.sleep(0.5)  # the half message's header reaches the receiver first
        started = time.monotonic()
        sender.send(receiver.address, *pages("other", 16))
        req_id, at = landed.get(timeout=3 * PAYLOAD_TIMEOUT_S)
        assert req_id == "other"
        assert at - started < PAYLOAD_TIMEOUT_S / 2  # not behind the stopped sender's tensors
        assert sender.take_failed() == []
    finally:
        sender.close()
        stopped.kill()
        stopped.join(timeout=10)
        receiver.close()
