"""How a tensor message looks on the wire, shared by the UCX and the ZeroMQ tensor channels.

A tensor message is one small msgpack envelope followed by one raw buffer per tensor:

    envelope = (specs, header)       # msgspec-encoded: list[TensorSpec] and the caller's header
    frame i  = the bytes of tensor i # C-contiguous, no serialization, sent from the tensor's memory

The envelope carries dtype and shape so that the receiver can size (or check) its buffers before the
payload lands; the caller's header (request ids, layer, ...) is any msgspec type, typically a tagged
union from `common.protocol`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeAlias

import msgspec
import numpy as np
import torch
from torch.utils.dlpack import to_dlpack

from common.attention.cpu_kernel import extension
from common.transport.zmq_sockets import HeaderT

# The csrc extension's strided frame copies (`pack_frames`); None: the numpy path.
_FRAMES = extension()
_FRAMES = _FRAMES if hasattr(_FRAMES, "pack_frames") else None

# Names on the wire (stable strings, not torch reprs) and the torch dtype each one means.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


class TensorSpec(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """dtype name and shape of one tensor frame."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * DTYPES[self.dtype].itemsize


def spec_of(tensor: torch.Tensor) -> TensorSpec:
    """The wire spec of `tensor`; raises on dtypes the wire does not carry."""
    name = DTYPE_NAMES.get(tensor.dtype)
    if name is None:
        raise TypeError(f"tensor dtype {tensor.dtype} cannot travel; supported: {list(DTYPES)}")
    return TensorSpec(name, tuple(tensor.shape))


def array_view(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor with its shape and strides (never a copy).

    Writing to it writes the tensor. numpy has no bfloat16, so bfloat16 is viewed as int16 (the
    wire moves bytes). Built with numpy, not torch, ops: each torch view op costs microseconds of
    dispatch.
    """
    tensor = _travelling(tensor)
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy()


def _travelling(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as its bytes are read or written on the wire: on the CPU, detached."""
    if not tensor.is_cpu:
        raise ValueError(f"only CPU tensors travel here, got {tensor.device}")
    return tensor.detach() if tensor.requires_grad else tensor


def byte_view(tensor: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a CPU tensor's memory; a contiguous copy if it is strided.

    The result keeps the tensor alive through numpy's base reference.
    """
    array = array_view(tensor)
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return array.reshape(-1).view(np.uint8)  # [nbytes]


def copy_bytes_into(target: torch.Tensor, data: np.ndarray | memoryview) -> None:
    """Copy a frame's raw bytes into `target`, which may be strided (a slice of a larger tensor):
    one pass, no staging copy."""
    view = array_view(target)
    view[...] = np.frombuffer(data, dtype=view.dtype).reshape(view.shape)


def copy_tensor_into(buffer: np.ndarray, tensor: torch.Tensor) -> None:
    """Copy `tensor` (possibly strided) into the uint8 `buffer` of exactly its size, C order."""
    source = array_view(tensor)
    buffer.view(source.dtype).reshape(source.shape)[...] = source


def pack_frames(
    buffer: np.ndarray, offsets: Sequence[int], tensors: Sequence[torch.Tensor]
) -> None:
    """buffer[offsets[i]:] = tensors[i]'s bytes in C order (tensors possibly strided; `buffer`
    flat uint8). In one call to the csrc extension where it is built (a fraction of the cost of
    the numpy views and copies below), else tensor by tensor."""
    if _FRAMES is not None:
        _FRAMES.pack_frames(buffer, offsets, [_dlpack(t) for t in tensors])
        return
    for offset, tensor in zip(offsets, tensors, strict=True):
        copy_tensor_into(buffer[offset : offset + nbytes(tensor)], tensor)


def unpack_frames(
    buffer: np.ndarray, offsets: Sequence[int], targets: Sequence[torch.Tensor]
) -> None:
    """Each target (possibly strided, written in place) = buffer[offsets[i]:]'s bytes in C order;
    the extension's one call where it is built, as `pack_frames`."""
    if _FRAMES is not None:
        _FRAMES.unpack_frames(buffer, offsets, [_dlpack(t) for t in targets])
        return
    for offset, target in zip(offsets, targets, strict=True):
        copy_bytes_into(target, buffer[offset : offset + nbytes(target)])


def nbytes(tensor: torch.Tensor) -> int:
    """The bytes `tensor`'s elements take on the wire (dense, whatever its strides)."""
    return tensor.numel() * tensor.element_size()


def _dlpack(tensor: torch.Tensor) -> Any:
    return to_dlpack(_travelling(tensor))


def empty_like_spec(spec: TensorSpec) -> torch.Tensor:
    """A fresh tensor to receive a frame described by `spec`."""
    return torch.empty(spec.shape, dtype=DTYPES[spec.dtype])


# Where received tensors land: fresh tensors (None), these tensors, or the tensors a function picks
# once the header is known (e.g. the KV slots of the request and layer it names). Targets may be
# strided (slices of a larger tensor): the bytes land in place, without a staging copy.
ReceiveInto: TypeAlias = (
    Sequence[torch.Tensor] | Callable[[Any, list["TensorSpec"]], Sequence[torch.Tensor]] | None
)


class TensorLink(Protocol):
    """What a tensor channel offers its user, UCX or ZeroMQ underneath: a send that returns a
    handle to `wait` on (the tensors stay alive until then), and a receive into `out`."""

    def send_async(self, header: Any, tensors: Sequence[torch.Tensor]) -> Any: ...
    def wait(self, handle: Any, timeout: float | None = ...) -> Any: ...
    def recv(
        self, out: ReceiveInto = None, timeout: float | None = ...
    ) -> tuple[Any, list[torch.Tensor]]: ...


def receive_targets(specs: list[TensorSpec], header: Any, out: ReceiveInto) -> list[torch.Tensor]:
    """The tensors a message described by `specs` is received into (checked against the specs)."""
    if out is None:
        return [empty_like_spec(s) for s in specs]
    targets = out(header, specs) if callable(out) else out
    if len(specs) != len(targets):
        raise ValueError(f"message has {len(specs)} tensors, {len(targets)} receive buffers given")
    return [check_out(spec, t) for spec, t in zip(specs, targets, strict=True)]


def check_out(spec: TensorSpec, out: torch.Tensor) -> torch.Tensor:
    """Check that a caller-provided receive buffer matches the incoming frame's dtype and shape
    (it may be strided: a slice of a larger tensor)."""
    if spec_of(out) != spec:
        raise ValueError(f"receive buffer {out.dtype}{tuple(out.shape)} does not match {spec}")
    return out


class EnvelopeCodec(Generic[HeaderT]):
    """One encoder and one typed decoder for `(specs, header)`, built once per channel."""

    def __init__(self, header_type: Any) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(tuple[list[TensorSpec], header_type])

    def encode(self, header: HeaderT, tensors: Sequence[torch.Tensor]) -> bytes:
        return self._encoder.encode(([spec_of(t) for t in tensors], header))

    def decode(self, data: bytes | memoryview) -> tuple[list[TensorSpec], HeaderT]:
        """Decode an envelope; raises msgspec.DecodeError on malformed or unknown input."""
        specs, header = self._decoder.decode(data)
        return specs, header

    def to_frames(self, header: HeaderT, tensors: Sequence[torch.Tensor]) -> list[Any]:
        """A tensor message as ZeroMQ frames: the envelope, then each tensor's bytes (no copy)."""
        return [self.encode(header, tensors), *(byte_view(t.contiguous()) for t in tensors)]

    def from_frames(self, frames: Sequence[Any]) -> tuple[HeaderT, list[torch.Tensor]]:
        """The message `to_frames` made, its tensors over the frames' own memory. Raises
        msgspec's errors, or ValueError, on a malformed one."""
        specs, header = self.decode(frames[0].buffer)
        if len(specs) != len(frames) - 1:
            raise ValueError(f"{len(specs)} tensor specs, {len(frames) - 1} frames")
        pairs = zip(specs, frames[1:], strict=True)
        return header, [frame_tensor(spec.dtype, spec.shape, f.buffer) for spec, f in pairs]


def frame_tensor(dtype: str, shape: tuple[int, ...], buffer: memoryview) -> torch.Tensor:
    """A tensor over a received frame's own memory (no copy); ValueError on an unknown dtype."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown tensor dtype {dtype!r}")
    if not len(buffer):
        return torch.empty(shape, dtype=DTYPES[dtype])
    return torch.frombuffer(buffer, dtype=torch.uint8).view(DTYPES[dtype]).view(shape)
