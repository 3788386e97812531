"""Transport: typed ZeroMQ sockets (control plane) and tensor channels (tensor plane).

- `zmq_sockets`: `TypedSocket` (any socket type: ROUTER/DEALER commands and replies, PUSH/PULL
  commands and token streams, PUB/SUB load reports), `PushPool`, `bind_random`; one msgspec
  encoder and typed decoder per socket; malformed messages are logged and dropped.
- `service_stats`: `request_stats`, what each service holds, asked on its control endpoint.
- `tensor_frames`: the wire form of a tensor message (msgspec envelope + raw buffers).
- `ucx_channel` / `ucx_listener` / `ucx_handshake`: `UcxTensorChannel` / `UcxListener` and how
  they meet, the UCX (ucxx) tensor channel. Not imported
  here: importing ucxx costs time and is only needed by tensor-plane processes.
- `zmq_tensor`: `ZmqTensorChannel`, the same API over ZeroMQ frames (fallback and yardstick).
"""

from common.transport.service_stats import request_stats
from common.transport.tensor_frames import DTYPES, EnvelopeCodec, TensorSpec, byte_view
from common.transport.zmq_sockets import PushPool, TypedSocket, bind_random
from common.transport.zmq_tensor import ZmqTensorChannel

__all__ = [
    "DTYPES",
    "EnvelopeCodec",
    "PushPool",
    "TensorSpec",
    "TypedSocket",
    "ZmqTensorChannel",
    "bind_random",
    "byte_view",
    "request_stats",
]
