"""How two UCX workers meet: which network device a worker listens on, and the signed hello.

A listener publishes its worker address; a peer creates an endpoint to it and sends a hello on
`HELLO_TAG`: `[channel id | length | its own worker address | HMAC-SHA256 of all that, keyed by
the mesh's key]`. The listener checks the signature before UCX reads the peer's address (UCX
aborts the process on a forged one), connects back, and acknowledges on `ACK_TAG`, so a peer
with another mesh's key learns at once that it was refused instead of waiting for replies that
never come. Pure functions; `ucx_channel.py` and `ucx_listener.py` use them.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import ipaddress
import socket
import struct

HELLO = struct.Struct("<QI")  # channel id, length of the peer's worker address that follows
HELLO_MAX_BYTES = 4096
SIGNATURE_BYTES = 32  # HMAC-SHA256 over the hello, after the peer's address
# Data tags use the low 58 bits (`ucx_channel._tag`): a hello or an ack never matches one.
HELLO_TAG = 1 << 63
ACK_TAG = (1 << 63) | 1
ACK = struct.Struct("<Q")  # the accepted channel id
_SIOCGIFADDR = 0x8915


def net_device_for(host: str | None) -> str | None:
    """The network device a worker serving `host` should listen on: `lo` for a loopback host, the
    interface that holds `host`'s address otherwise; None (every device) if none is found."""
    if not host:
        return None
    try:
        address = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return None
    if address.is_loopback:
        return "lo"
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:  # the interface's IPv4 address
                request = struct.pack("256s", name[:15].encode())
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue
        if socket.inet_ntoa(packed[20:24]) == str(address):
            return name
    return None


def signed_hello(channel_id: int, own_address: bytes, key: bytes) -> bytes:
    hello = HELLO.pack(channel_id, len(own_address)) + own_address
    return hello + hmac.digest(key, hello, hashlib.sha256)


def verified_hello(hello: bytes, key: bytes) -> tuple[int, bytes]:
    """The channel id and peer worker address of a correctly signed hello; ValueError if not."""
    channel_id, length = HELLO.unpack_from(hello)
    end = HELLO.size + length
    if end + SIGNATURE_BYTES > HELLO_MAX_BYTES:
        raise ValueError(f"a hello announcing a peer address of {length} bytes")
    expected = hmac.digest(key, hello[:end], hashlib.sha256)
    if not hmac.compare_digest(expected, hello[end : end + SIGNATURE_BYTES]):
        raise ValueError("a hello not signed with the mesh's key")
    return channel_id, hello[HELLO.size : end]
