"""Tensors over ZeroMQ: the fallback for (and the yardstick of) the UCX tensor channel.

Same API and wire layout as `UcxTensorChannel`: a message is `[envelope, frame, frame, ...]` with
the msgspec envelope `(specs, header)` and one raw frame per tensor. Frames are sent with
`copy=False` from the tensor's memory: pyzmq holds a reference to each buffer until libzmq has
sent it, and `track=True` returns a `zmq.MessageTracker` that says when the memory may change again
(messages whose frames are all under `zmq.COPY_THRESHOLD`, 64 KiB, are copied and done at
once). Received frames
become tensors without a copy (`torch.frombuffer` keeps the frame alive), or are copied into `out`.

Both ends are DEALER sockets (one binds, one connects): a point-to-point pipe that reconnects.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic

import msgspec
import structlog
import torch
import zmq

from common.transport.tensor_frames import (
    DTYPES,
    EnvelopeCodec,
    HeaderT,
    ReceiveInto,
    TensorSpec,
    byte_view,
    copy_bytes_into,
    receive_targets,
)

log = structlog.get_logger(__name__)
_SENT = zmq.MessageTracker()  # a tracker with nothing to wait for


class ZmqTensorChannel(Generic[HeaderT]):
    """Sends and receives `(header, tensors)` to one peer over a DEALER-DEALER zmq pipe."""

    def __init__(self, endpoint: str, header_type: Any, *, bind: bool,
                 context: zmq.Context[Any] | None = None) -> None:  # fmt: skip
        self.sock = (context or zmq.Context.instance()).socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self._codec: EnvelopeCodec[HeaderT] = EnvelopeCodec(header_type)
        if bind:
            self.sock.bind(endpoint)
            self.endpoint: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self.sock.connect(endpoint)
            self.endpoint = endpoint

    def send(self, header: HeaderT, tensors: Sequence[torch.Tensor] = (),
             timeout: float | None = 30.0) -> None:  # fmt: skip
        """Send; returns once zmq no longer needs the tensors' memory."""
        self.wait(self.send_async(header, tensors), timeout)

    def send_async(
        self, header: HeaderT, tensors: Sequence[torch.Tensor] = ()
    ) -> zmq.MessageTracker:
        """Queue a send; the tensors must not change until `wait(tracker)` returns."""
        frames: list[Any] = [self._codec.encode(header, tensors)]
        frames += [byte_view(t) for t in tensors]
        if all(f.nbytes < zmq.COPY_THRESHOLD for f in frames[1:]):
            # Small frames are copied by pyzmq anyway; tracking them would only add a hand-off
            # through pyzmq's garbage-collector thread on every wait.
            self.sock.send_multipart(frames, copy=True)
            return _SENT
        tracker = self.sock.send_multipart(frames, copy=False, track=True)
        assert isinstance(tracker, zmq.MessageTracker)
        return tracker

    @staticmethod
    def wait(tracker: zmq.MessageTracker, timeout: float | None = 30.0) -> None:
        """Block until libzmq has released every frame of a `send_async`."""
        if not tracker.done:
            tracker.wait(-1 if timeout is None else timeout)

    def recv(self, out: ReceiveInto = None,
             timeout: float | None = None) -> tuple[HeaderT, list[torch.Tensor]]:  # fmt: skip
        """Receive one message into `out` (tensors, or a function of (header, specs) returning
        them; exact dtypes and shapes) or into zero-copy tensors over the
        received frames. A malformed message is logged and dropped, and the next one is read."""
        while True:
            timeout_ms = None if timeout is None else max(0, int(timeout * 1000))
            if not self.sock.poll(timeout_ms, zmq.POLLIN):
                raise TimeoutError(f"no tensor message on {self.endpoint} within {timeout} s")
            frames = self.sock.recv_multipart(copy=False)
            decoded = self._decode(frames)
            if decoded is not None:
                specs, header = decoded
                return header, _tensors_from_frames(specs, header, frames[1:], out)

    def _decode(self, frames: list[zmq.Frame]) -> tuple[list[TensorSpec], HeaderT] | None:
        try:
            specs, header = self._codec.decode(frames[0].buffer)
        except msgspec.DecodeError as exc:
            log.warning("zmq_tensor_message_dropped", error=str(exc), num_frames=len(frames))
            return None
        sizes = [len(f.buffer) for f in frames[1:]]
        if sizes != [s.nbytes for s in specs]:
            log.warning("zmq_tensor_message_dropped", error="frame sizes do not match specs",
                        sizes=sizes)  # fmt: skip
            return None
        return specs, header

    def close(self, linger: float = 1.0) -> None:
        """Close the socket, giving queued outgoing messages up to `linger` seconds to leave."""
        self.sock.close(linger=int(linger * 1000))


def _tensors_from_frames(
    specs: list[TensorSpec], header: Any, frames: Sequence[zmq.Frame], out: ReceiveInto
) -> list[torch.Tensor]:
    if out is None:  # zero-copy: each tensor keeps its frame alive
        return [_frame_tensor(spec, frame) for spec, frame in zip(specs, frames, strict=True)]
    targets = receive_targets(specs, header, out)
    for frame, target in zip(frames, targets, strict=True):
        copy_bytes_into(target, frame.buffer)
    return targets


def _frame_tensor(spec: TensorSpec, frame: zmq.Frame) -> torch.Tensor:
    dtype = DTYPES[spec.dtype]
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=dtype)
    return torch.frombuffer(frame.buffer, dtype=dtype).view(spec.shape)
