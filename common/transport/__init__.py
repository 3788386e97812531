"""Transport: typed ZeroMQ sockets (control plane) and tensor channels (tensor plane).

- `zmq_sockets`: `TypedSocket` (any socket type: ROUTER/DEALER commands and replies, PUSH/PULL
  commands and token streams, PUB/SUB load reports), `PushPool`, `bind_random`; one msgspec
  encoder and typed decoder per socket; malformed messages are logged and dropped.
- `service_stats`: `request_stats`, what each service holds, asked on its control endpoint.
- `tensor_frames`: the wire form of a tensor message (msgspec envelope + raw buffers).
- `ucx_channel` / `ucx_listener` / `ucx_handshake`: `UcxTensorChannel` / `UcxListener` and how
  they meet, the UCX (ucxx) tensor channel.
- `zmq_tensor`: `ZmqTensorChannel`, the same API over ZeroMQ frames (fallback and yardstick).

Nothing is imported here: each process imports the modules it uses, so that one whose sockets
carry messages alone (the Router) imports neither torch (`tensor_frames`) nor ucxx.
"""
