"""Transport: typed ZeroMQ sockets (control plane) and tensor channels (tensor plane).

- `zmq_channels`: ROUTER/DEALER commands, PUSH/PULL token streams, PUB/SUB load reports; one msgspec
  encoder and typed decoder per socket; malformed messages are logged and dropped.
- `tensor_frames`: the wire form of a tensor message (msgspec envelope + raw buffers).
- `ucx_channel`: `UcxListener` / `UcxTensorChannel`, the UCX (ucxx) tensor channel. Not imported
  here: importing ucxx costs time and is only needed by tensor-plane processes.
- `zmq_tensor`: `ZmqTensorChannel`, the same API over ZeroMQ frames (fallback and yardstick).
"""

from common.transport.tensor_frames import DTYPES, EnvelopeCodec, TensorSpec, byte_view
from common.transport.zmq_channels import (
    CommandDealer,
    CommandRouter,
    LoadPublisher,
    LoadSubscriber,
    MessageSocket,
    StreamPull,
    StreamPush,
)
from common.transport.zmq_tensor import ZmqTensorChannel

__all__ = [
    "DTYPES",
    "CommandDealer",
    "CommandRouter",
    "EnvelopeCodec",
    "LoadPublisher",
    "LoadSubscriber",
    "MessageSocket",
    "StreamPull",
    "StreamPush",
    "TensorSpec",
    "ZmqTensorChannel",
    "byte_view",
]
