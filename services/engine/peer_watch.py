"""Which peers an engine has lost: ZeroMQ tells when a connection drops and when it is back.

A router replica that dies takes its inbox with it; its requests would otherwise decode on until
their queue to it filled (1,000 messages). `PeerWatch` follows the connection events of the
engine's PUSH sockets (to routers, and to the engines and shards it sends to): an endpoint that
has been down for `grace_s` without connecting (dropped, or never reached: ZeroMQ retries every
0.1 s) is lost. The engine ends the requests that report to it, retryably, and closes the socket
to it, queue and all (`PushPool.drop`), so nothing keeps reconnecting to a peer that is gone; a
peer that comes back at that endpoint gets a fresh socket with the next message for it.
"""

from __future__ import annotations

import zmq
from zmq.utils.monitor import recv_monitor_message

LOST_AFTER_S = 5.0  # ZeroMQ retries a dropped connection every 0.1 s: 5 s is not a blip
# Connected; dropped or a connect retried (down); and the socket closed (its monitor ends).
_EVENTS = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_MONITOR_STOPPED
)


class PeerWatch:
    """Connection state of the PUSH sockets it watches; `lost(now)` names the lost endpoints."""

    def __init__(self, grace_s: float = LOST_AFTER_S) -> None:
        self.grace_s = grace_s
        self._monitors: list[zmq.Socket] = []
        self._down_since: dict[str, float] = {}

    def watch(self, sock: zmq.Socket) -> None:
        self._monitors.append(sock.get_monitor_socket(_EVENTS))

    def on_event(self, endpoint: str, connected: bool, now: float) -> None:
        if connected:
            self._down_since.pop(endpoint, None)
        else:
            self._down_since.setdefault(endpoint, now)

    def lost(self, now: float) -> list[str]:
        """Endpoints down for `grace_s` or more. Each then starts over: the owner closes its
        socket (an endpoint whose socket still retries would be named again after `grace_s`)."""
        for monitor in list(self._monitors):
            while monitor.poll(0):
                event = recv_monitor_message(monitor)
                if event["event"] == zmq.EVENT_MONITOR_STOPPED:  # its socket was closed
                    self._monitors.remove(monitor)
                    monitor.close(linger=0)
                    break
                connected = event["event"] == zmq.EVENT_CONNECTED
                self.on_event(event["endpoint"].decode(), connected, now)
        lost = [e for e, since in self._down_since.items() if now - since >= self.grace_s]
        for endpoint in lost:
            del self._down_since[endpoint]
        return lost

    def close(self) -> None:
        for monitor in self._monitors:
            monitor.close(linger=0)
        self._monitors.clear()
