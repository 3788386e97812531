"""`EngineKvPorts`: an engine's ends of the UCX KV links (`common/transport/kv_links.py`).

A prompt or mixed engine ships KV through a `KvSender`, started on its first UCX transfer. A token
or mixed engine receives KV on a `KvReceiver` when `kv_over_ucx` is on; received pages wait in a
`KvInbox` for the engine's loop (the engine is single-threaded), which polls the inbox's fd with
its ZeroMQ sockets.
"""

from __future__ import annotations

import torch

from common.protocol import KvPages, ShardIngress
from common.roles import Role
from common.transport.kv_links import KvInbox, KvReceiver, KvSender
from common.worker_config import WorkerConfig


class EngineKvPorts:
    def __init__(self, cfg: WorkerConfig) -> None:
        self._host, self._key = cfg.host, bytes.fromhex(cfg.mesh_key)
        receives = cfg.options.kv_over_ucx and cfg.role in (Role.TOKEN, Role.MIXED)
        self.inbox = KvInbox() if receives else None
        self._receiver = KvReceiver(self._host, self._key, self.inbox.put) if self.inbox else None
        self.address = self._receiver.address if self._receiver else ""  # "": none here
        self._sender: KvSender | None = None

    def send(self, address: str, pages: KvPages, k: torch.Tensor, v: torch.Tensor) -> None:
        if self._sender is None:
            self._sender = KvSender(self._host, self._key)
        self._sender.send(address, pages, k, v)

    def received(self) -> list[tuple[ShardIngress, list[torch.Tensor]]]:
        return self.inbox.drain() if self.inbox else []

    def undelivered(self) -> list[str]:
        """Requests whose KV transfer failed since the last call."""
        return self._sender.take_failed() if self._sender else []

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
        if self._receiver is not None:
            self._receiver.close()
        if self.inbox is not None:
            self.inbox.close()


__all__ = ["EngineKvPorts"]
