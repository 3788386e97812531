"""ZeroMQ CURVE for the control plane: only processes that hold the mesh's key can talk to it.

Every mesh has one secret (`WorkerConfig.mesh_key`, drawn per deploy; the UCX hellos are signed
with the same one, `ucx_handshake.py`). Both CURVE key pairs are derived from it, so nothing but
that one secret is distributed: every socket that binds is a CURVE server with the mesh's server
key pair, every socket that connects a CURVE client with its client key pair.

A peer without the secret cannot complete the handshake: a CURVE client must know the server's
long-term public key to box its HELLO, and ours is derived from the secret and never leaves a
process. So libzmq closes such a connection before a single message reaches the socket: a forged
`Shutdown`, `AbortRequest` or `TokenOutput` from outside the mesh is never decoded. Messages are
encrypted and authenticated too (a peer on the path cannot read or alter them).

No ZAP handler is installed: knowing the server key is the credential, so a ZAP check of the
client's key would test the same secret twice at the price of a thread per process.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

import zmq
from zmq.utils import z85


@dataclass(frozen=True)
class CurveKeys:
    """The mesh's two CURVE key pairs (Z85 text, as libzmq takes them)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def from_mesh_key(cls, mesh_key: str) -> CurveKeys:
        """Both key pairs from the mesh's secret (hex). Raises ValueError for an empty key."""
        secret = bytes.fromhex(mesh_key)
        if len(secret) < 16:
            raise ValueError("the mesh key must hold at least 16 bytes (32 hex digits)")
        server_secret = _derive(secret, b"phasemesh zmq curve server")
        client_secret = _derive(secret, b"phasemesh zmq curve client")
        return cls(
            server_public=zmq.curve_public(server_secret),
            server_secret=server_secret,
            client_public=zmq.curve_public(client_secret),
            client_secret=client_secret,
        )

    def serve(self, sock: zmq.Socket) -> None:
        """Make `sock` (before it binds) accept only peers that hold the mesh key."""
        sock.curve_secretkey = self.server_secret
        sock.curve_publickey = self.server_public
        sock.curve_server = True

    def join(self, sock: zmq.Socket) -> None:
        """Make `sock` (before it connects) reach the mesh's CURVE servers."""
        sock.curve_secretkey = self.client_secret
        sock.curve_publickey = self.client_public
        sock.curve_serverkey = self.server_public


def _derive(secret: bytes, label: bytes) -> bytes:
    """A CURVE secret key (32 bytes, Z85) for one purpose; HMAC keeps the labels independent."""
    return z85.encode(hmac.new(secret, label, hashlib.sha256).digest())
