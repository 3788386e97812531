"""Tensor bytes into and out of one message buffer (`pack_frames` / `unpack_frames`): the csrc
extension's strided copies against the numpy path, byte for byte, and their refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.transport import tensor_frames
from common.transport.tensor_frames import pack_frames, unpack_frames
from tests.kernel_gate import kernel_gate


def sources() -> list[torch.Tensor]:
    """Strided and dense tensors of every kind the mesh sends: head slices of a fused qkv row,
    a transposed bfloat16, integers, booleans, a 0-d and an empty tensor."""
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, 8 * 16, generator=gen)
    q = qkv[:, : 4 * 16].view(5, 4, 16)[:, 1:3]  # strided: a shard's query heads
    v = qkv[:, 6 * 16 :].view(5, 2, 16)[:, 1:2]
    bf16 = torch.randn(3, 7, generator=gen).to(torch.bfloat16).t()
    ids = torch.arange(12, dtype=torch.int64).view(3, 4)[:, ::2]
    flags = torch.tensor([True, False, True])
    return [q, v, bf16, ids, flags, torch.tensor(2.5), torch.empty(0, 4)]


def layout(tensors: list[torch.Tensor], start: int = 16) -> tuple[list[int], int]:
    offsets, offset = [], start
    for t in tensors:
        offsets.append(offset)
        offset += (t.numel() * t.element_size() + 63) // 64 * 64
    return offsets, offset


def packed(tensors: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch, native: bool) -> bytes:
    if not native:
        monkeypatch.setattr(tensor_frames, "_FRAMES", None)
    offsets, size = layout(tensors)
    buffer = np.full(size, 0xAB, np.uint8)
    pack_frames(buffer, offsets, tensors)
    monkeypatch.undo()
    return buffer.tobytes()


def test_numpy_path_writes_each_tensor_in_c_order(monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = sources()
    data = packed(tensors, monkeypatch, native=False)
    offsets, _ = layout(tensors)
    for t, offset in zip(tensors, offsets, strict=True):
        flat = t.contiguous().reshape(-1)
        raw = (flat.view(torch.int16) if t.dtype == torch.bfloat16 else flat).numpy().tobytes()
        assert data[offset : offset + len(raw)] == raw


@kernel_gate("csrc extension not built")
def test_extension_packs_the_numpy_paths_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = sources()
    assert packed(tensors, monkeypatch, native=True) == packed(tensors, monkeypatch, native=False)


@pytest.mark.parametrize("native", [True, False], ids=["extension", "numpy"])
def test_unpack_writes_strided_targets_in_place(
    monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    if native and tensor_frames._FRAMES is None:
        pytest.skip("csrc extension not built")
    tensors = sources()
    data = np.frombuffer(packed(tensors, monkeypatch, native=False), np.uint8)
    if not native:
        monkeypatch.setattr(tensor_frames, "_FRAMES", None)
    # Targets that are themselves slices of larger tensors (a reply landing in its rows).
    bigger = [torch.zeros((t.shape[0] + 2, *t.shape[1:]) if t.dim() else (), dtype=t.dtype)
              for t in tensors]  # fmt: skip
    targets = [
        b[1 : 1 + t.shape[0]] if t.dim() else b for b, t in zip(bigger, tensors, strict=True)
    ]
    offsets, _ = layout(tensors)
    unpack_frames(data.copy(), offsets, targets)
    for got, want, big in zip(targets, tensors, bigger, strict=True):
        assert torch.equal(got, want)
        if want.dim():  # the rows around the slice were not touched
            assert not big[0].any() and not big[-1].any()


@kernel_gate("csrc extension not built")
def test_extension_refuses_frames_outside_the_buffer_before_writing() -> None:
    tensors = sources()[:2]
    offsets, size = layout(tensors)
    buffer = np.zeros(size - 64, np.uint8)  # the second frame does not fit
    with pytest.raises(ValueError, match="outside a buffer"):
        pack_frames(buffer, offsets, tensors)
    assert not buffer.any()  # nothing written: the first frame fits, but all are checked first
    with pytest.raises(ValueError, match="one offset per tensor"):
        pack_frames(buffer, offsets[:1], tensors)
    with pytest.raises(ValueError, match="outside a buffer"):
        unpack_frames(buffer, [-1], tensors[:1])


@pytest.mark.parametrize("native", [True, False], ids=["extension", "numpy"])
def test_a_tensor_off_the_cpu_is_refused(monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    if native and tensor_frames._FRAMES is None:
        pytest.skip("csrc extension not built")
    if not native:
        monkeypatch.setattr(tensor_frames, "_FRAMES", None)
    buffer = np.zeros(256, np.uint8)
    with pytest.raises(ValueError, match="only CPU tensors"):
        pack_frames(buffer, [0], [torch.empty(4, device="meta")])
    with pytest.raises(ValueError, match="only CPU tensors"):
        unpack_frames(buffer, [0], [torch.empty(4, device="meta")])
    assert not buffer.any()


@kernel_gate("csrc extension not built")
def test_extension_refuses_more_dimensions_than_it_walks() -> None:
    buffer = np.zeros(64, np.uint8)
    with pytest.raises(ValueError, match="at most 8"):
        pack_frames(buffer, [0], [torch.zeros([1] * 9)])
    pack_frames(buffer, [0], [torch.ones([1] * 8)])  # 8 is fine
    assert buffer[:4].view(np.float32)[0] == 1.0
