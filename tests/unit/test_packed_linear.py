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
