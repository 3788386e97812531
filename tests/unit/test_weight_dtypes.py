"""Projections on bfloat16 and int8 weights (common/model/linear.py `weight_dtype`): the extension's
panel GEMM on low-precision panels against a float64 reference, its refusals, and the tiny model
in each weight dtype against float32."""

from __future__ import annotations

import pytest
import torch
from torch.utils.dlpack import to_dlpack

from common.model.linear import (
    PANEL_WIDTH,
    POST_ATTENTION_MAX_ROWS,
    PackedLinear,
    get_matmul_precision,
    kernel_gemm_available,
    matmul_precision,
    pack_linears,
    pack_panels,
    packed_weight_bytes,
    post_attention,
    quantize_int8,
    set_matmul_precision,
)
from tests.kernel_gate import kernel_gate

pytestmark = kernel_gate(
    "csrc extension without bfloat16/int8 panels",
    built=kernel_gemm_available("bfloat16") and kernel_gemm_available("int8"),
)

LOW_DTYPES = ["bfloat16", "int8"]


def _layer(weight_dtype: str, out_features: int, in_features: int, seed: int = 0) -> PackedLinear:
    torch.manual_seed(seed)
    layer = PackedLinear(in_features, out_features, bias=False).requires_grad_(False)
    layer.pack(weight_dtype=weight_dtype)
    assert layer.panels is not None and layer.weight_dtype == weight_dtype
    return layer


def _stored_weight(layer: PackedLinear) -> torch.Tensor:
    """The weight the panels hold, in float64: bfloat16-rounded, or q * scale."""
    if layer.weight_dtype == "int8":
        q, scales = quantize_int8(layer.weight)
        return q.double() * scales.double()[:, None]
    return layer.weight.to(torch.bfloat16).double()


@pytest.mark.parametrize("weight_dtype", LOW_DTYPES)
@pytest.mark.parametrize(
    "shape", [(1, 1), (PANEL_WIDTH + 1, 70), (PANEL_WIDTH + 20, 70), (257, 768)]
)
def test_low_precision_gemm_against_float64(weight_dtype, shape):
    """Every column (the partly filled last panel too) and every row-tile tail against float64
    on the stored weight (the kernel's only rounding is float32 accumulation: 1e-6 relative per
    input), and within the quantization's own bound of the float32 weight's result."""
    out_features, in_features = shape
    layer = _layer(weight_dtype, out_features, in_features)
    stored = _stored_weight(layer)
    # bfloat16: each weight within 2^-8 relative; int8: within half its channel's scale.
    if weight_dtype == "int8":
        per_weight = (layer.weight.abs().amax(dim=1, keepdim=True).double() / 127 / 2).expand_as(
            stored
        )
    else:
        per_weight = layer.weight.abs().double() * 2**-8
    assert ((stored - layer.weight.double()).abs() <= per_weight * 1.0001 + 1e-12).all()
    for rows in (1, 5, 13, 77):
        x = torch.randn(rows, in_features)
        want = x.double() @ stored.T
        got = layer.forward(x).double()
        assert (got - want).abs().max() <= 1e-6 * in_features * (1 + want.abs().max())
        exact = x.double() @ layer.weight.double().T
        bound = x.double().abs() @ per_weight.T
        assert ((got - exact).abs() <= bound * 1.001 + 1e-5).all()
        residual = torch.randn(rows, out_features)
        # int8's scale and the add are one FMA (one rounding where the two steps take two).
        torch.testing.assert_close(
            layer.forward_add(x, residual), residual + layer.forward(x), atol=1e-6, rtol=1e-6
        )


@pytest.mark.parametrize("weight_dtype", LOW_DTYPES)
def test_every_isa_and_rows_alone_bitwise(weight_dtype):
    """Each ISA's build agrees with float64 on the stored weight; a row's result is the same
    bits alone, in a batch, on any thread count, and in a row slice or the fused activation."""
    from common.attention.cpu_kernel import extension, supported_isas

    ext = extension()
    layer = _layer(weight_dtype, 4 * PANEL_WIDTH, 96, seed=3)
    stored = _stored_weight(layer)
    x = torch.randn(19, 96)
    q, channel_scales = quantize_int8(layer.weight)
    raw = q if weight_dtype == "int8" else layer.weight.to(torch.bfloat16)
    want = x.double() @ stored.T
    for isa in supported_isas():
        panels, scales = _isa_panels(
            raw, channel_scales if weight_dtype == "int8" else None, ext.linear_panel_width(isa)
        )
        out = torch.empty(19, 4 * PANEL_WIDTH)
        ext.linear(to_dlpack(x), to_dlpack(panels), to_dlpack(out), None, 0, 2, isa,
                   scales=None if scales is None else to_dlpack(scales))  # fmt: skip
        assert (out.double() - want).abs().max() <= 1e-6 * 96 * (1 + want.abs().max()), isa
    batch = layer.forward(x)
    for row in (0, 11, 18):
        assert torch.equal(layer.forward(x[row : row + 1]), batch[row : row + 1])
    torch.set_num_threads(1)
    try:
        assert torch.equal(layer.forward(x), batch)
    finally:
        torch.set_num_threads(2)
    cols = slice(PANEL_WIDTH + 3, 3 * PANEL_WIDTH)
    assert torch.equal(layer.forward_rows(x, cols.start, cols.stop), batch[:, cols])
    on_boundary = layer.forward_rows(x, PANEL_WIDTH, 2 * PANEL_WIDTH)
    assert torch.equal(on_boundary, batch[:, PANEL_WIDTH : 2 * PANEL_WIDTH])
    inter = 2 * PANEL_WIDTH
    act = layer.forward_silu_and_mul(x)
    gate, up = batch[:, :inter], batch[:, inter:]
    torch.testing.assert_close(act, torch.nn.functional.silu(gate) * up, atol=1e-5, rtol=1e-5)


def _isa_panels(raw: torch.Tensor, scales: torch.Tensor | None, width: int):
    """`raw` [out, in] packed for a panel width, and int8 scales padded to the panels' columns."""
    panels = pack_panels(raw, width)
    if scales is None:
        return panels, None
    padded = torch.zeros(panels.shape[0] * width)
    padded[: len(scales)] = scales
    return panels, padded


@pytest.mark.parametrize("in_features", [6, 7])
def test_bfloat16_panels_hold_their_rows_in_pairs(in_features):
    """The layout the kernel reads (pack_panels): rows k, k + 1 (k even) of a panel as [W][2],
    an odd last row as it is, the padded columns zero; float32 panels keep plain rows."""
    width, out_features = 4, 6
    weight = torch.arange(out_features * in_features, dtype=torch.float32).view(out_features, -1)
    panels = pack_panels(weight.to(torch.bfloat16), width).float()
    assert panels.shape == (2, in_features, width)
    flat = panels.view(2, -1)
    for c in range(2 * width):
        p, col = divmod(c, width)
        for k in range(in_features):
            if k + 1 < in_features or in_features % 2 == 0:  # in a pair
                at = (k - k % 2) * width + 2 * col + k % 2
            else:  # the unpaired last row
                at = k * width + col
            want = weight[c, k] if c < out_features else 0.0
            assert flat[p, at] == want, (c, k)
    plain = pack_panels(weight, width)
    assert torch.equal(plain[0, :, 1], weight[1])


@pytest.mark.parametrize("weight_dtype", ["float32", *LOW_DTYPES])
def test_few_rows_over_any_panel_count_bitwise(weight_dtype):
    """Decode's row counts (1-3) on every ISA, for 1 to 9 panels (the last partly filled) and an
    odd input width (int8's and bfloat16's panel rows are shorter than a cache line): each row's
    outputs (scaled, plus a residual) are the bits of the same row in a batch of 13 (a full tile
    and a tail), on one thread or two, and agree with float64 on the stored weight."""
    from common.attention.cpu_kernel import extension, supported_isas

    ext = extension()
    torch.manual_seed(5)
    in_features, batch = 37, 13
    x = torch.randn(batch, in_features)
    for isa in supported_isas():
        width = ext.linear_panel_width(isa)
        for num_panels in range(1, 10):
            out_features = num_panels * width - 3
            weight = torch.randn(out_features, in_features)
            if weight_dtype == "int8":
                raw, scales = quantize_int8(weight)
                stored = raw.double() * scales.double()[:, None]
            else:
                raw, scales = weight.to(_PANEL_DTYPE[weight_dtype]), None
                stored = raw.double()
            panels, padded = _isa_panels(raw, scales, width)
            residual = torch.randn(batch, out_features)
            whole = _run_linear(ext, isa, x, panels, padded, residual, 2)
            want = residual.double() + x.double() @ stored.T
            assert (whole.double() - want).abs().max() <= 1e-6 * in_features * (
                1 + want.abs().max()
            ), (isa, num_panels)
            for start, rows in ((0, 1), (6, 2), (10, 3), (12, 1)):
                part = slice(start, start + rows)
                for threads in (1, 2):
                    alone = _run_linear(ext, isa, x[part], panels, padded, residual[part], threads)
                    assert torch.equal(alone, whole[part]), (isa, num_panels, rows)


def _run_linear(ext, isa, x, panels, scales, residual, threads):  # type: ignore[no-untyped-def]
    """The extension's `linear` on one ISA: x @ w.T + residual."""
    out = torch.empty(x.shape[0], residual.shape[1])
    ext.linear(to_dlpack(x.contiguous()), to_dlpack(panels), to_dlpack(out),
               to_dlpack(residual.contiguous()), 0, threads, isa,
               scales=None if scales is None else to_dlpack(scales))  # fmt: skip
    return out


_PANEL_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.mark.parametrize("in_features", [96, 37])
def test_bfloat16_products_against_float64_on_every_isa(in_features):
    """Matmul precision "medium": bfloat16 panels times x rounded to bfloat16 (each product exact
    in float32). Against float64 on the rounded x and the stored weight; the same bits on every
    ISA (vdpbf16ps where the CPU has AVX512_BF16, FMAs in its order elsewhere); a row's bits the
    same alone, in a batch, on one thread or two; a non-finite row harms no batch mate."""
    from common.attention.cpu_kernel import extension, supported_isas

    ext = extension()
    torch.manual_seed(7)
    out_features, batch = 5 * PANEL_WIDTH - 3, 19
    raw = torch.randn(out_features, in_features).to(torch.bfloat16)
    x = torch.randn(batch, in_features)
    residual = torch.randn(batch, out_features)
    rounded = x.to(torch.bfloat16).double()
    want = residual.double() + rounded @ raw.double().T
    highest = _run_linear(ext, "auto", x, pack_panels(raw, PANEL_WIDTH), None, residual, 2)
    outs = {}
    with matmul_precision("medium"):
        for isa in supported_isas():
            panels = pack_panels(raw, ext.linear_panel_width(isa))
            whole = _run_linear(ext, isa, x, panels, None, residual, 2)
            assert (whole.double() - want).abs().max() <= 1e-6 * in_features * (
                1 + want.abs().max()
            ), isa
            for start, rows in ((0, 1), (4, 2), (6, 3), (9, 10)):
                part = slice(start, start + rows)
                for threads in (1, 2):
                    alone = _run_linear(ext, isa, x[part], panels, None, residual[part], threads)
                    assert torch.equal(alone, whole[part]), (isa, rows, threads)
            outs[isa] = whole
            poisoned = x.clone()
            poisoned[3] = float("nan")
            poisoned[5, 0] = float("inf")
            mixed = _run_linear(ext, isa, poisoned, panels, None, residual, 2)
            assert mixed[3].isnan().all() and not mixed[5].isfinite().all()
            keep = [r for r in range(batch) if r not in (3, 5)]
            assert torch.equal(mixed[keep], whole[keep])
    first = next(iter(outs.values()))
    assert all(torch.equal(first, out) for out in outs.values())
    # The AVX-512 build's own FMA form (what an AVX-512 CPU without AVX512_BF16 runs), where
    # this CPU would take vdpbf16ps: the same bits.
    if "avx512" in outs:
        panels = pack_panels(raw, ext.linear_panel_width("avx512"))
        ext._set_bf16_products_as_fmas(True)
        try:
            with matmul_precision("medium"):
                as_fmas = _run_linear(ext, "avx512", x, panels, None, residual, 2)
        finally:
            ext._set_bf16_products_as_fmas(False)
        assert torch.equal(as_fmas, outs["avx512"])
    # Not the float32 activations' result: x was rounded.
    assert not torch.equal(first, highest)


def test_matmul_precision_is_process_wide_restored_and_checked():
    """The word is checked; the block's precision is restored after it, an error inside too;
    float32 and int8 panels compute the same bits under either; bfloat16's fused activation
    under "medium" is its two calls' bits."""
    assert get_matmul_precision() == "highest"
    with pytest.raises(ValueError, match="highest, medium"):
        set_matmul_precision("high")
    with pytest.raises(RuntimeError, match="inside"), matmul_precision("medium"):
        assert get_matmul_precision() == "medium"
        raise RuntimeError("inside")
    assert get_matmul_precision() == "highest"
    x = torch.randn(5, 64)
    for weight_dtype in ("float32", "int8"):
        layer = _layer(weight_dtype, 2 * PANEL_WIDTH, 64)
        before = layer.forward(x)
        with matmul_precision("medium"):
            assert torch.equal(layer.forward(x), before), weight_dtype
    layer = _layer("bfloat16", 4 * PANEL_WIDTH, 64)
    with matmul_precision("medium"):
        batch = layer.forward(x)
        act = layer.forward_silu_and_mul(x)
    inter = 2 * PANEL_WIDTH
    torch.testing.assert_close(
        act, torch.nn.functional.silu(batch[:, :inter]) * batch[:, inter:], atol=1e-5, rtol=1e-5
    )
    assert not torch.equal(batch, layer.forward(x))  # restored: x float32 again


def test_bfloat16_products_greedy_tokens_alone_equal_their_batch(tiny_model_path):
    """Through the engine's fused decode step on bfloat16 panels at "medium": each prompt's
    greedy tokens alone are its tokens in a batch of four (x is rounded per row, so a row's
    bits do not depend on its batch mates)."""
    from common.engine.core import LLMEngine
    from common.sampling_params import SamplingParams

    engine = LLMEngine.from_path(tiny_model_path, num_blocks=256)
    pack_linears(engine.model, weight_dtype="bfloat16")
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(8, 500, (n,), generator=gen).tolist() for n in (5, 17, 33, 9)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, detokenize=False)
    with matmul_precision("medium"):
        together = engine.generate(prompts, params)
        alone = [engine.generate([p], params)[0] for p in prompts]
    assert together == alone
    assert all(len(t) == 12 for t in together)


def test_bfloat16_products_a_replayed_request_continues_with_its_tokens(tiny_model_path):
    """What token-replay migration does when an engine dies mid-request: another engine
    prefills the prompt with the tokens already streamed and decodes the rest. At "medium" the
    rest is the tokens the first engine would have made (prefill and decode round each row of x
    alone, whatever the row count), on a fresh engine without the first one's prefix cache."""
    from common.engine.core import LLMEngine
    from common.sampling_params import SamplingParams

    def engine() -> LLMEngine:
        e = LLMEngine.from_path(tiny_model_path, num_blocks=256)
        pack_linears(e.model, weight_dtype="bfloat16")
        return e

    prompt = torch.randint(8, 500, (21,), generator=torch.Generator().manual_seed(4)).tolist()
    greedy = {"temperature": 0.0, "ignore_eos": True, "detokenize": False}
    with matmul_precision("medium"):
        whole = engine().generate([prompt], SamplingParams(max_tokens=16, **greedy))[0]
        for streamed in (1, 7, 15):
            rest = engine().generate(
                [prompt + whole[:streamed]], SamplingParams(max_tokens=16 - streamed, **greedy)
            )[0]
            assert whole[:streamed] + rest == whole, streamed


def test_a_bad_matmul_precision_in_the_environment_fails_the_load(tiny_model_path, monkeypatch):
    """PHASEMESH_MATMUL_PRECISION with another word fails the model's load with the choices
    named, before anything is packed; the process's precision stays what it was."""
    from common.model.loader import load_model

    monkeypatch.setenv("PHASEMESH_MATMUL_PRECISION", "bfloat16; rm -rf /")
    with pytest.raises(ValueError, match="highest, medium"):
        load_model(tiny_model_path)
    assert get_matmul_precision() == "highest"
    monkeypatch.setenv("PHASEMESH_MATMUL_PRECISION", "medium")
    try:
        load_model(tiny_model_path)
        assert get_matmul_precision() == "medium"
    finally:
        set_matmul_precision("highest")


def test_refusals():
    """int8 panels without scales, scales with bfloat16 panels, a short scale vector, panels of
    a dtype the GEMM lacks, and an unknown weight dtype at pack time."""
    from common.attention.cpu_kernel import extension

    ext = extension()
    int8 = _layer("int8", 2 * PANEL_WIDTH, 16)
    bf16 = _layer("bfloat16", 2 * PANEL_WIDTH, 16)
    x, out = torch.randn(2, 16), torch.empty(2, 2 * PANEL_WIDTH)
    with pytest.raises(ValueError, match="need scales"):
        ext.linear(to_dlpack(x), to_dlpack(int8.panels), to_dlpack(out), None)
    with pytest.raises(ValueError, match="need scales"):
        ext.linear(to_dlpack(x), to_dlpack(bf16.panels), to_dlpack(out), None,
                   scales=to_dlpack(int8.scales))  # fmt: skip
    with pytest.raises(ValueError, match="scales"):
        ext.linear(to_dlpack(x), to_dlpack(int8.panels), to_dlpack(out), None,
                   scales=to_dlpack(int8.scales[:-1].contiguous()))  # fmt: skip
    with pytest.raises(ValueError, match="float32, bfloat16 or int8"):
        ext.linear(to_dlpack(x), to_dlpack(int8.panels.to(torch.int16)), to_dlpack(out), None)
    with pytest.raises(ValueError, match="unknown weight dtype"):
        PackedLinear(16, 16, bias=False).pack(weight_dtype="int4")


def test_quantize_int8_zero_channel_and_extremes():
    weight = torch.tensor([[0.0, 0.0], [1.0, -0.5], [-2.0, 2.0]])
    q, scales = quantize_int8(weight)
    assert q.tolist() == [[0, 0], [127, -64], [-127, 127]]
    assert torch.equal(scales, torch.tensor([1.0, 1 / 127, 2 / 127]))


@pytest.fixture(scope="module")
def tiny_logits(tiny_model_path):
    """The tiny model's prefill logits on one prompt, per weight dtype, and bytes per step."""
    from common.model.loader import load_model

    model = load_model(tiny_model_path, "float32", "float32")
    ids = torch.randint(
        8, model.config.vocab_size, (96,), generator=torch.Generator().manual_seed(0)
    )
    logits, nbytes = {}, {}
    for weight_dtype in ("float32", *LOW_DTYPES):
        pack_linears(model, weight_dtype=weight_dtype)
        nbytes[weight_dtype] = packed_weight_bytes(model)
        with torch.inference_mode():
            logits[weight_dtype] = model.forward_prefill(ids, [96])
    pack_linears(model, weight_dtype="bfloat16")
    nbytes[MEDIUM] = packed_weight_bytes(model)
    with torch.inference_mode(), matmul_precision("medium"):
        logits[MEDIUM] = model.forward_prefill(ids, [96])
    return logits, nbytes


MEDIUM = "bfloat16_medium"  # bfloat16 panels at matmul precision "medium"


# Stated tolerances for the tiny model (random weights, 4 layers): the largest logit difference
# from float32, as a fraction of float32's logit spread (max - min per position).
LOGIT_TOLERANCE = {"bfloat16": 0.01, "int8": 0.03, MEDIUM: 0.02}


@pytest.mark.parametrize("weight_dtype", [*LOW_DTYPES, MEDIUM])
def test_tiny_model_logits_and_greedy_tokens_near_float32(tiny_logits, weight_dtype):
    logits, nbytes = tiny_logits
    ref, got = logits["float32"], logits[weight_dtype]
    spread = (ref.amax(dim=1) - ref.amin(dim=1)).min()
    diff = (got - ref).abs().amax(dim=1)
    assert diff.max() <= LOGIT_TOLERANCE[weight_dtype] * spread
    # Greedy tokens agree wherever float32's top-2 margin exceeds twice the difference.
    top2 = ref.topk(2, dim=1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * diff
    assert clear.sum() >= len(clear) // 2
    assert torch.equal(got.argmax(dim=1)[clear], ref.argmax(dim=1)[clear])
    # Fewer bytes a step: bfloat16 half of float32's, int8 a quarter plus its scales.
    share = {"bfloat16": 0.5, "int8": 0.25, MEDIUM: 0.5}[weight_dtype]
    assert share <= nbytes[weight_dtype] / nbytes["float32"] <= share * 1.05


def test_a_bfloat16_model_packs_bfloat16_panels_and_keeps_its_dtype(tiny_model_path):
    from common.model.loader import load_model

    model = load_model(tiny_model_path, "bfloat16")
    layer = model.layers[0].self_attn.qkv_proj
    assert layer.panels is not None and layer.panels.dtype == torch.bfloat16
    x = torch.randn(3, layer.in_features, dtype=torch.bfloat16)
    out = layer.forward(x)
    assert out.dtype == torch.bfloat16
    want = x.double() @ layer.weight.double().T
    torch.testing.assert_close(out.double(), want, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("weight_dtype", ["float32", *LOW_DTYPES])
def test_post_attention_in_one_call_has_the_separate_calls_bits(tiny_model_path, weight_dtype):
    """A decode step's O projection, residual, norm and MLP as one extension call: every row
    count up to its bound gives the bits of the calls one by one; past it, the calls run."""
    from common.model import layer_ops
    from common.model.loader import load_model

    model = load_model(tiny_model_path, weight_dtype=weight_dtype)
    layer = model.layers[1]
    attn_mod, mlp, norm = layer.self_attn, layer.mlp, layer.post_attention_layernorm
    torch.manual_seed(1)
    for rows in (1, 5, POST_ATTENTION_MAX_ROWS, POST_ATTENTION_MAX_ROWS + 1):
        x = torch.randn(rows, attn_mod.o_proj.out_features)
        attn = torch.randn(rows, attn_mod.num_heads, attn_mod.head_dim)
        flat = attn.reshape(rows, -1)
        total, h = layer_ops.add_rms_norm(x, attn_mod.o_proj.forward(flat), norm.weight, norm.eps)
        separate = mlp.down_proj.forward_add(mlp.gate_up_proj.forward_silu_and_mul(h), total)
        one_call = post_attention(
            x, flat, attn_mod.o_proj, norm.weight, norm.eps, mlp.gate_up_proj, mlp.down_proj
        )
        assert (one_call is None) == (rows > POST_ATTENTION_MAX_ROWS)
        if one_call is not None:
            assert torch.equal(one_call, separate)
        assert torch.equal(layer.post_attention(x, attn), separate)
