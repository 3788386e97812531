"""PackedLinear: the packed projections (the extension's panel GEMM, oneDNN) against F.linear and a
float64 reference on the same weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.model.linear import (
    MIN_PACKED_ROWS,
    PANEL_WIDTH,
    PackedLinear,
    kernel_gemm_available,
    onednn_available,
    pack_linears,
)
from tests.kernel_gate import kernel_gate

needs_kernel = kernel_gate("csrc extension not built", built=kernel_gemm_available())

BACKENDS = [
    pytest.param("kernel", marks=needs_kernel),
    pytest.param(
        "onednn", marks=pytest.mark.skipif(not onednn_available(), reason="torch without oneDNN")
    ),
]


def _linear(out_features: int = 96, in_features: int = 64) -> PackedLinear:
    torch.manual_seed(0)
    return PackedLinear(in_features, out_features, bias=False).requires_grad_(False)


def _packed(backend: str, out_features: int = 96, in_features: int = 64) -> PackedLinear:
    layer = _linear(out_features, in_features)
    layer.pack(backend=backend)
    assert (layer.panels is not None) == (backend == "kernel")
    assert (layer.packed is not None) == (backend == "onednn")
    return layer


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows", [1, MIN_PACKED_ROWS, 7, 32, 300])
def test_packed_matches_f_linear(backend, rows):
    layer = _packed(backend)
    x = torch.randn(rows, 64)
    torch.testing.assert_close(layer.forward(x), F.linear(x, layer.weight), atol=1e-5, rtol=1e-5)
    residual = torch.randn(rows, 96)
    torch.testing.assert_close(
        layer.forward_add(x, residual), residual + F.linear(x, layer.weight), atol=1e-5, rtol=1e-5
    )


@needs_kernel
@pytest.mark.parametrize(
    "shape", [(1, 1), (PANEL_WIDTH, 3), (PANEL_WIDTH + 1, 70), (PANEL_WIDTH + 20, 70), (257, 768)]
)
def test_kernel_gemm_against_float64(shape):
    """Every column (the last, partly filled panel too) and every row-tile tail, against a
    float64 reference, with the residual added after the sum."""
    out_features, in_features = shape
    layer = _packed("kernel", out_features, in_features)
    for rows in (1, 5, 13, 64, 77):
        x = torch.randn(rows, in_features)
        want = x.double() @ layer.weight.double().T
        got = layer.forward(x).double()
        assert (got - want).abs().max() <= 1e-6 * in_features * (1 + want.abs().max())
        residual = torch.randn(rows, out_features)
        assert torch.equal(layer.forward_add(x, residual), residual + layer.forward(x))


@needs_kernel
def test_kernel_gemm_on_every_isa_this_cpu_runs():
    """Each ISA's build of the GEMM (the engine runs the best; the others serve other CPUs):
    against float64, every row-tile tail, rows alone bitwise."""
    from torch.utils.dlpack import to_dlpack

    from common.attention.cpu_kernel import extension, supported_isas
    from common.model.linear import pack_panels

    torch.manual_seed(1)
    weight, x = torch.randn(75, 40), torch.randn(30, 40)
    want = x.double() @ weight.double().T
    for isa in supported_isas():
        panels = pack_panels(weight, extension().linear_panel_width(isa))
        outs = []
        for rows in (30, 1, 7, 13):
            out = torch.empty(rows, 75)
            extension().linear(to_dlpack(x[:rows].clone()), to_dlpack(panels), to_dlpack(out),
                               None, 0, 2, isa)  # fmt: skip
            outs.append(out)
        assert (outs[0].double() - want).abs().max() < 1e-4, isa
        for out in outs[1:]:
            assert torch.equal(out, outs[0][: out.shape[0]]), isa


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_row_does_not_depend_on_its_batch_mates(backend):
    """Greedy parity across batch compositions wants each row's result alone."""
    layer = _packed(backend, 200, 96)
    x = torch.randn(80, 96)
    full = layer.forward(x)
    smallest = 1 if backend == "kernel" else MIN_PACKED_ROWS  # 1 row is MKL's with oneDNN
    for rows in range(smallest, 80):
        assert torch.equal(layer.forward(x[:rows].clone()), full[:rows]), rows


@needs_kernel
def test_kernel_rows_do_not_depend_on_the_thread_count():
    layer = _packed("kernel", 300, 64)
    x = torch.randn(40, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = layer.forward(x)
        torch.set_num_threads(3)
        assert torch.equal(layer.forward(x), alone)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_non_finite_row_leaves_its_batch_mates_alone(backend):
    """An edge-value request's NaN or inf activations stay in its own rows: its batch mates get
    the bits they get without it."""
    layer = _packed(backend, 200, 96)
    x = torch.randn(9, 96)
    alone = layer.forward(x[1:].clone())
    for poison in (float("nan"), float("inf"), -float("inf"), 3e38):
        hostile = x.clone()
        hostile[0, 5] = poison
        out = layer.forward(hostile)
        assert torch.equal(out[1:], alone), poison
        assert not torch.isfinite(out[0]).all() or poison == 3e38


@needs_kernel
def test_concurrent_callers_get_their_own_results():
    """The kernel keeps no state between calls: two threads at once (an engine's step and
    another engine's in the same process) each get what they get alone."""
    import threading

    layer = _packed("kernel", 300, 64)
    inputs = [torch.randn(rows, 64) for rows in (1, 8, 33, 70)]
    expected = [layer.forward(x) for x in inputs]
    failures: list[int] = []

    def run(index: int) -> None:
        for _ in range(50):
            if not torch.equal(layer.forward(inputs[index]), expected[index]):
                failures.append(index)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


@needs_kernel
def test_kernel_refuses_wrong_dtypes_layouts_and_isas():
    from torch.utils.dlpack import to_dlpack

    from common.attention.cpu_kernel import extension

    layer = _packed("kernel")
    out = torch.empty(4, 96)
    x = torch.randn(4, 64)
    for bad_x in (x.double(), x.to(torch.bfloat16), torch.randn(64, 4).t()):
        with pytest.raises(TypeError):
            extension().linear(to_dlpack(bad_x), to_dlpack(layer.panels), to_dlpack(out), None)
    with pytest.raises((TypeError, ValueError)):  # panels of a dtype the GEMM lacks
        extension().linear(to_dlpack(x), to_dlpack(layer.panels.double()), to_dlpack(out), None)
    with pytest.raises(ValueError, match="unknown isa"):
        extension().linear(to_dlpack(x), to_dlpack(layer.panels), to_dlpack(out), None, 0, 1,
                           "sse9")  # fmt: skip
    with pytest.raises(ValueError, match="num_threads"):
        extension().linear(to_dlpack(x), to_dlpack(layer.panels), to_dlpack(out), None, 0, 0)


@needs_kernel
def test_kernel_refuses_mismatched_shapes():
    from torch.utils.dlpack import to_dlpack

    from common.attention.cpu_kernel import extension

    layer = _packed("kernel")
    out = torch.empty(4, 96)
    with pytest.raises(ValueError, match="panels must be"):
        extension().linear(to_dlpack(torch.randn(4, 63)), to_dlpack(layer.panels),
                           to_dlpack(out), None, 0, 1)  # fmt: skip
    with pytest.raises(ValueError, match="overrun"):
        extension().linear(to_dlpack(torch.randn(4, 64)), to_dlpack(layer.panels),
                           to_dlpack(out), None, 1, 1)  # fmt: skip
    with pytest.raises(ValueError, match="residual"):
        extension().linear(to_dlpack(torch.randn(4, 64)), to_dlpack(layer.panels),
                           to_dlpack(out), to_dlpack(torch.randn(3, 96)), 0, 1)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_or_other_dtype_input(backend):
    """A view is made contiguous, and an input of another dtype cast to the weight's."""
    layer = _packed(backend)
    wide = torch.randn(8, 128)
    torch.testing.assert_close(layer.forward(wide[:, :64]), F.linear(wide[:, :64], layer.weight))
    half = torch.randn(8, 64).to(torch.bfloat16)
    assert torch.equal(layer.forward(half), layer.forward(half.float()))
    gate_up = _packed(backend, 2 * max(PANEL_WIDTH, 8), 64)  # the fused activation's input too
    assert torch.equal(gate_up.forward_silu_and_mul(wide[:, :64]),
                       gate_up.forward_silu_and_mul(wide[:, :64].contiguous()))  # fmt: skip
    assert torch.equal(gate_up.forward_silu_and_mul(half),
                       gate_up.forward_silu_and_mul(half.float()))  # fmt: skip


@pytest.mark.skipif(
    not onednn_available() and not kernel_gemm_available("bfloat16"), reason="no bfloat16 path"
)
def test_bfloat16_takes_the_kernel_or_onednn():
    bf16 = _linear().to(torch.bfloat16)
    bf16.pack()  # the kernel's bfloat16 panels where built, else oneDNN
    if kernel_gemm_available("bfloat16"):
        assert bf16.panels is not None and bf16.panels.dtype == torch.bfloat16
    else:
        assert bf16.panels is None and bf16.packed is not None
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    out = bf16.forward(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), F.linear(x, bf16.weight).float(), atol=0.1, rtol=0.02)


def test_unpacked_is_f_linear():
    """Never packed: plain F.linear on the weight."""
    layer = _linear()
    x = torch.randn(5, 64)
    assert not layer.is_packed
    assert torch.equal(layer.forward(x), F.linear(x, layer.weight))
    assert torch.equal(layer.forward_add(x, x.new_ones(5, 96)), 1 + F.linear(x, layer.weight))
    with pytest.raises(ValueError, match="unknown backend"):
        layer.pack(backend="mkl")


def test_pack_linears_packs_every_projection(tiny_model_path):
    from common.model.loader import load_model

    model = load_model(tiny_model_path)
    projections = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(projections) == 4 * model.config.num_hidden_layers + 1  # + the LM head
    expected = len(projections) if kernel_gemm_available() or onednn_available() else 0
    assert pack_linears(model) == expected


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows", [1, MIN_PACKED_ROWS, 8, 33])
def test_a_row_slice_is_the_fused_projections_columns(backend, rows):
    """Early q computes the fused QKV's q rows, then its k/v rows: each slice gives the fused
    projection's columns (bitwise for both paths here; 1e-5 is the contract). The kernel runs a
    slice that starts on a panel boundary on the fused panels, and packs any other."""
    layer = _packed(backend)
    x = torch.randn(rows, 64)
    full = layer.forward(x)
    slices = ((0, 64), (64, 96), (16, 48))
    for start, end in slices:
        part = layer.forward_rows(x, start, end)
        torch.testing.assert_close(part, full[:, start:end], atol=1e-5, rtol=1e-5)
    if backend == "kernel":
        own = {s for s in slices if s[0] % PANEL_WIDTH}
        assert layer.packed_rows is not None and layer.packed_rows.keys() == own
    else:
        assert layer.packed_rows is not None and len(layer.packed_rows) == (3 if rows > 1 else 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pack_again_repacks_the_slices_and_unpack_drops_them(backend):
    layer = _packed(backend)
    x = torch.randn(8, 64)
    layer.forward_rows(x, 16, 48)
    layer.weight.mul_(2)  # a weight changed after packing is packed again
    layer.pack(backend=backend)
    assert layer.packed_rows == {}
    torch.testing.assert_close(layer.forward_rows(x, 16, 48), F.linear(x, layer.weight[16:48]))
    torch.testing.assert_close(layer.forward_rows(x, 0, 32), F.linear(x, layer.weight[:32]))
    layer.unpack()
    assert not layer.is_packed and layer.packed_rows is None
    assert torch.equal(layer.forward_rows(x, 0, 32), F.linear(x, layer.weight[:32]))
    layer.pack(backend=backend)
    with pytest.raises(ValueError, match="outside"):
        layer.forward_rows(x, 90, 100)


def test_unpacked_row_slice_is_f_linear_on_the_slice():
    """PHASEMESH_PACKED_WEIGHTS=0 (or no packed path): F.linear on the weight's rows."""
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
    qkv = model.layers[0].self_attn.qkv_proj
    if not packed or not qkv.is_packed:
        assert not qkv.packed_rows
    elif qkv.panels is not None:  # both halves start on a panel boundary: no copies
        assert qkv.packed_rows == {}
    else:
        assert qkv.packed_rows is not None and qkv.packed_rows.keys() == {(0, 256), (256, 384)}
    for rows in (1, 8, 32):
        x = torch.randn(rows, model.config.hidden_size)
        rope = model.rotary_at(torch.arange(rows) * 3)
        for layer in model.layers[:2]:
            q, k, v = layer.pre_attention(x, rope)
            h, q_early = layer.pre_attention_q(x, rope)
            k_late, v_late = layer.pre_attention_kv(h, rope)
            for fused, split in ((q, q_early), (k, k_late), (v, v_late)):
                assert torch.equal(fused, split)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("inter", [2 * PANEL_WIDTH, 3 * PANEL_WIDTH + 5])
def test_gate_up_with_its_activation_equals_the_two_steps(backend, inter):
    """`forward_silu_and_mul`, fused in the kernel's threads where the halves split on a panel
    boundary (else the two steps): bitwise what the projection then `silu_and_mul` give, at
    every row count and thread count, and against float64."""
    from common.model import layer_ops

    layer = _packed(backend, 2 * inter, 64)
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2, 3):
            torch.set_num_threads(num_threads)
            for rows in (1, 7, 32, 77):
                x = torch.randn(rows, 64) * 2
                two_steps = layer_ops.silu_and_mul(layer.forward(x))
                assert torch.equal(layer.forward_silu_and_mul(x), two_steps), (num_threads, rows)
    finally:
        torch.set_num_threads(threads)
    gate, up = (x.double() @ layer.weight.double().T).chunk(2, dim=-1)
    want = gate * torch.sigmoid(gate) * up
    torch.testing.assert_close(layer.forward_silu_and_mul(x).double(), want, rtol=1e-4, atol=1e-5)


@needs_kernel
def test_a_non_finite_row_leaves_its_batch_mates_activations_alone():
    """The fused gate|up + activation: an edge-value request's NaN or inf stays in its own row."""
    layer = _packed("kernel", 4 * PANEL_WIDTH, 96)
    x = torch.randn(9, 96)
    alone = layer.forward_silu_and_mul(x[1:].clone())
    for poison in (float("nan"), float("inf"), -float("inf"), 3e38):
        hostile = x.clone()
        hostile[0, 5] = poison
        assert torch.equal(layer.forward_silu_and_mul(hostile)[1:], alone), poison


@needs_kernel
def test_fused_activation_on_every_isa_and_its_refusals():
    """Each ISA's fused gate|up + activation equals its own GEMM then the activation computed
    column range by column range; shapes that do not split on a panel boundary are refused."""
    from torch.utils.dlpack import to_dlpack

    from common.attention.cpu_kernel import extension, supported_isas
    from common.model.linear import pack_panels

    ext = extension()
    torch.manual_seed(2)
    for isa in supported_isas():
        width = ext.linear_panel_width(isa)
        inter = 3 * width
        weight, x = torch.randn(2 * inter, 40), torch.randn(13, 40)
        panels = pack_panels(weight, width)
        gate_up, act = torch.empty(13, 2 * inter), torch.empty(13, inter)
        ext.linear_silu_and_mul(to_dlpack(x), to_dlpack(panels), to_dlpack(gate_up),
                                to_dlpack(act), 2, isa)  # fmt: skip
        plain = torch.empty(13, 2 * inter)
        ext.linear(to_dlpack(x), to_dlpack(panels), to_dlpack(plain), None, 0, 1, isa)
        assert torch.equal(gate_up, plain), isa
        g, u = plain.double().chunk(2, dim=-1)
        torch.testing.assert_close(act.double(), g * torch.sigmoid(g) * u, rtol=1e-4, atol=1e-5)
    width = ext.linear_panel_width("auto")
    panels = pack_panels(torch.randn(2 * width + 2, 40), width)
    with pytest.raises(ValueError, match="not a multiple of the panel width"):
        ext.linear_silu_and_mul(to_dlpack(torch.randn(4, 40)), to_dlpack(panels),
                                to_dlpack(torch.empty(4, 2 * width + 2)),
                                to_dlpack(torch.empty(4, width + 1)), 1)  # fmt: skip
    panels = pack_panels(torch.randn(2 * width, 40), width)
    with pytest.raises(ValueError, match="act has shape"):
        ext.linear_silu_and_mul(to_dlpack(torch.randn(4, 40)), to_dlpack(panels),
                                to_dlpack(torch.empty(4, 2 * width)),
                                to_dlpack(torch.empty(3, width)), 1)  # fmt: skip
    with pytest.raises(ValueError, match="panels must be"):
        ext.linear_silu_and_mul(to_dlpack(torch.randn(4, 40)), to_dlpack(panels),
                                to_dlpack(torch.empty(4, 4 * width)),
                                to_dlpack(torch.empty(4, 2 * width)), 1)  # fmt: skip


@needs_kernel
def test_a_build_without_low_precision_panels_falls_back_with_a_note(monkeypatch):
    """An extension built before the bfloat16/int8 panels (stood in for by the dtype list it
    reports): int8 packs float32 panels and bfloat16 oneDNN's copy, each logged once."""
    import common.model.linear as linear

    monkeypatch.setattr(linear, "KERNEL_WEIGHT_DTYPES", ("float32",))
    monkeypatch.setattr(linear, "_NOTED", set())
    layer = _linear()
    layer.pack(weight_dtype="int8")
    assert layer.weight_dtype == "float32" and layer.panels is not None
    assert layer.panels.dtype == torch.float32 and layer.scales is None
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer.forward(x), F.linear(x, layer.weight), atol=1e-5, rtol=1e-5)
    layer.pack(weight_dtype="bfloat16")
    assert layer.panels is None and (layer.packed is not None) == onednn_available()
    assert layer.forward(x).dtype == torch.float32
    assert linear._NOTED == {"int8", "bfloat16"}
