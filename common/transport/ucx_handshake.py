"""How two UCX workers meet: which network device a worker listens on, and the signed hello.

A listener publishes its worker address; a peer creates an endpoint to it and sends a hello on
`HELLO_TAG`: `[channel id | sent at | length | its own worker address | HMAC-SHA256 of all that,
keyed by the mesh's key]`. The listener checks the signature before UCX reads the peer's address
(UCX aborts the process on a forged one), and refuses a hello sent more than `HELLO_MAX_AGE_S` ago
(or ahead) or one whose random channel id it has accepted within that window (`ReplayGuard`): a
hello captured on the wire and sent again cannot steal a link. It then connects back and
acknowledges on `ACK_TAG`, so a peer with another mesh's key learns at once that it was refused
instead of waiting for replies that never come. `ucx_channel.py` and `ucx_listener.py` use these.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import socket
import struct
import time

import psutil

# Channel id (random per link), when it was sent (Unix seconds), length of the peer's address.
HELLO = struct.Struct("<QdI")
# A hello older (or further ahead, clocks differ between nodes) than this is refused; within it a
# channel id is accepted once.
HELLO_MAX_AGE_S = 300.0
HELLO_MAX_BYTES = 4096
SIGNATURE_BYTES = 32  # HMAC-SHA256 over the hello, after the peer's address
# Data tags use the low 58 bits (`ucx_channel._tag`): a hello or an ack never matches one.
HELLO_TAG = 1 << 63
ACK_TAG = (1 << 63) | 1
ACK = struct.Struct("<Q")  # the accepted channel id
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class MeshHostError(ValueError):
    """The mesh host is on no local network device: a UCX worker refuses to start
    rather than listen on every device."""


def net_device_for(host: str | None) -> str | None:
    """The network device a worker serving `host` listens on: `lo` for a loopback host, else the
    interface that holds `host`'s address (IPv4 or IPv6; a hostname by what it resolves to).
    None (every device) only when asked for: an empty or unspecified host (`0.0.0.0`, `::`).

    Raises `MeshHostError`, naming the host and the local interfaces, when no interface
    holds its address (a hostname that resolves elsewhere, a NAT'd node IP): listening on every
    device instead would open the mesh beyond the host it was given.
    """
    return _device_of(host)[0]


def ucx_device_options(host: str | None) -> dict[str, str]:
    """The UCX options that keep a worker on `host`'s network device (`net_device_for`): the
    device, and for an IPv6 host its IPv6 addresses (UCX's tcp prefers a device's IPv4 one)."""
    device, address = _device_of(host)
    if device is None:
        return {}
    return {"NET_DEVICES": device} | ({"TCP_AF_PRIO": "inet6"} if address.version == 6 else {})


def _device_of(host: str | None) -> tuple[str | None, IPAddress]:
    """`net_device_for(host)`, and the address of `host` it found there."""
    if not host:
        return None, ipaddress.ip_address("0.0.0.0")
    addresses = _resolved(host)
    for address in addresses:
        if address.is_unspecified:
            return None, address
    for address in addresses:
        if address.is_loopback:
            return "lo", address
    interfaces = {
        name: [_ip(a.address) for a in found if a.family in (socket.AF_INET, socket.AF_INET6)]
        for name, found in psutil.net_if_addrs().items()
    }
    for address in addresses:
        for name, held in interfaces.items():
            if address in held:
                return name, address
    listed = "; ".join(
        f"{n}: {', '.join(map(str, a)) or 'no address'}" for n, a in interfaces.items()
    )
    raise MeshHostError(
        f"mesh host {host!r} ({', '.join(map(str, addresses))}) is on no local network "
        f"interface (interfaces: {listed}); set the mesh host to one of these addresses"
    )


def _resolved(host: str) -> list[IPAddress]:
    """`host`'s addresses: itself if it is one (`[::1]` too), else what it resolves to."""
    try:
        return [_ip(host.strip("[]"))]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError as exc:
        raise MeshHostError(f"mesh host {host!r} does not resolve: {exc}") from exc
    return list(dict.fromkeys(_ip(str(info[4][0])) for info in infos))


def _ip(text: str) -> IPAddress:
    return ipaddress.ip_address(text.split("%")[0])  # without an IPv6 zone (`fe80::1%eth0`)


def signed_hello(
    channel_id: int, own_address: bytes, key: bytes, now: float | None = None
) -> bytes:
    sent_at = time.time() if now is None else now
    hello = HELLO.pack(channel_id, sent_at, len(own_address)) + own_address
    return hello + hmac.digest(key, hello, hashlib.sha256)


class ReplayGuard:
    """The channel ids a listener accepted within `max_age_s`: a hello is accepted once, and only
    while fresh (a signed hello replayed later, or again, is refused)."""

    def __init__(self, max_age_s: float = HELLO_MAX_AGE_S) -> None:
        self.max_age_s = max_age_s
        self._seen: dict[int, float] = {}  # channel id -> when its hello was sent

    def check(self, channel_id: int, sent_at: float, now: float) -> None:
        """ValueError for a stale, future or repeated hello; else remember it."""
        if abs(now - sent_at) > self.max_age_s:
            raise ValueError(f"a hello sent {now - sent_at:.0f} s from now (stale or replayed)")
        self._seen = {c: t for c, t in self._seen.items() if now - t <= self.max_age_s}
        if channel_id in self._seen:
            raise ValueError("a hello already accepted (replayed)")
        self._seen[channel_id] = sent_at


def verified_hello(hello: bytes, key: bytes) -> tuple[int, float, bytes]:
    """The channel id, send time and peer worker address of a correctly signed hello;
    ValueError if not."""
    channel_id, sent_at, length = HELLO.unpack_from(hello)
    end = HELLO.size + length
    if end + SIGNATURE_BYTES > HELLO_MAX_BYTES:
        raise ValueError(f"a hello announcing a peer address of {length} bytes")
    expected = hmac.digest(key, hello[:end], hashlib.sha256)
    if not hmac.compare_digest(expected, hello[end : end + SIGNATURE_BYTES]):
        raise ValueError("a hello not signed with the mesh's key")
    return channel_id, sent_at, hello[HELLO.size : end]
