"""PackedLinear: the oneDNN-packed projection against F.linear on the same weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.model.linear import MIN_PACKED_ROWS, PackedLinear, onednn_available, pack_linears

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")


def _linear(out_features: int = 96, in_features: int = 64) -> PackedLinear:
    torch.manual_seed(0)
    return PackedLinear(in_features, out_features, bias=False).requires_grad_(False)


@needs_onednn
@pytest.mark.parametrize("rows", [1, MIN_PACKED_ROWS, 7, 32, 300])
def test_packed_matches_f_linear(rows):
    layer = _linear()
    layer.pack()
    assert layer.packed is not None
    x = torch.randn(rows, 64)
    torch.testing.assert_close(layer.forward(x), F.linear(x, layer.weight), atol=1e-5, rtol=1e-5)
    residual = torch.randn(rows, 96)
    torch.testing.assert_close(
        layer.forward_add(x, residual), residual + F.linear(x, layer.weight), atol=1e-5, rtol=1e-5
    )


@needs_onednn
def test_a_row_does_not_depend_on_its_batch_mates():
    """Greedy parity across batch compositions wants each row's result alone."""
    layer = _linear()
    layer.pack()
    x = torch.randn(33, 64)
    full = layer.forward(x)
    for rows in (MIN_PACKED_ROWS, 8, 32):
        assert torch.equal(layer.forward(x[:rows]), full[:rows])


@needs_onednn
def test_non_contiguous_input_and_bfloat16():
    layer = _linear()
    layer.pack()
    wide = torch.randn(8, 128)
    torch.testing.assert_close(layer.forward(wide[:, :64]), F.linear(wide[:, :64], layer.weight))
    bf16 = _linear().to(torch.bfloat16)
    bf16.pack()
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    out = bf16.forward(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), F.linear(x, bf16.weight).float(), atol=0.1, rtol=0.02)


def test_unpacked_is_f_linear():
    """Never packed (or no oneDNN): plain F.linear on the weight."""
    layer = _linear()
    x = torch.randn(5, 64)
    assert layer.packed is None
    assert torch.equal(layer.forward(x), F.linear(x, layer.weight))
    assert torch.equal(layer.forward_add(x, x.new_ones(5, 96)), 1 + F.linear(x, layer.weight))


def test_pack_linears_packs_every_projection(tiny_model_path):
    from common.model.loader import load_model

    model = load_model(tiny_model_path)
    projections = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(projections) == 4 * model.config.num_hidden_layers + 1  # + the LM head
    assert pack_linears(model) == (len(projections) if onednn_available() else 0)


@needs_onednn
@pytest.mark.parametrize("rows", [1, MIN_PACKED_ROWS, 8, 33])
def test_a_row_slice_is_the_fused_projections_columns(rows):
    """Early q computes the fused QKV's q rows, then its k/v rows: each slice, packed on its own,
    gives the fused projection's columns (bitwise on this oneDNN; 1e-5 is the contract)."""
    layer = _linear()
    layer.pack()
    x = torch.randn(rows, 64)
    full = layer.forward(x)
    for start, end in ((0, 64), (64, 96), (16, 48)):
        part = layer.forward_rows(x, start, end)
        torch.testing.assert_close(part, full[:, start:end], atol=1e-5, rtol=1e-5)
    assert layer.packed_rows is not None and len(layer.packed_rows) == (3 if rows > 1 else 0)


@needs_onednn
def test_pack_again_repacks_the_slices_and_unpack_drops_them():
    layer = _linear()
    layer.pack()
    x = torch.randn(8, 64)
    layer.forward_rows(x, 0, 32)
    layer.weight.mul_(2)  # a weight changed after packing is packed again
    layer.pack()
    assert layer.packed_rows == {}
    torch.testing.assert_close(layer.forward_rows(x, 0, 32), F.linear(x, layer.weight[:32]))
    layer.unpack()
    assert layer.packed is None and layer.packed_rows is None
    assert torch.equal(layer.forward_rows(x, 0, 32), F.linear(x, layer.weight[:32]))
    layer.pack()
    with pytest.raises(ValueError, match="outside"):
        layer.forward_rows(x, 90, 100)


def test_unpacked_row_slice_is_f_linear_on_the_slice():
    """PHASEMESH_PACKED_WEIGHTS=0 (or no oneDNN): F.linear on the weight's rows."""
    layer = _linear()
    x = torch.randn(5, 64)
    assert torch.equal(layer.forward_rows(x, 10, 40), F.linear(x, layer.weight[10:40]))


@pytest.mark.parametrize("packed", [True, False])
def test_early_q_halves_equal_the_fused_pre_attention(tiny_model_path, monkeypatch, packed):
    """`pre_attention_q` + `pre_attention_kv` give `pre_attention`'s q, k and v bitwise, packed
    or not (PHASEMESH_PACKED_WEIGHTS=0), so overlap on and off decode the same logits."""
    from common.model.loader import load_model

    monkeypatch.setenv("PHASEMESH_PACKED_WEIGHTS", "1" if packed else "0")
    model = load_model(tiny_model_path)
    model.layers[0].pack_halves()  # as an engine with early q does at start-up
    assert (model.layers[0].self_attn.qkv_proj.packed_rows or {}).keys() == (
        {(0, 256), (256, 384)} if packed and onednn_available() else set()
    )
    for rows in (1, 8, 32):
        x = torch.randn(rows, model.config.hidden_size)
        rope = model.rotary_at(torch.arange(rows) * 3)
        for layer in model.layers[:2]:
            q, k, v = layer.pre_attention(x, rope)
            h, q_early = layer.pre_attention_q(x, rope)
            k_late, v_late = layer.pre_attention_kv(h, rope)
            for fused, split in ((q, q_early), (k, k_late), (v, v_late)):
                assert torch.equal(fused, split)
