"""Tokenizer: a Hugging Face `tokenizer.json` plus the chat template from `tokenizer_config.json`.

`build_byte_level_bpe` makes the default model's tokenizer: byte-level BPE, so any UTF-8 text
round-trips, trained on a seeded synthetic corpus because no text corpus can be downloaded here.
"""

from __future__ import annotations

import json
import random
import re
import secrets
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
START_HEADER, END_HEADER, EOT = "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"
SPECIAL_TOKENS = [BOS, EOS, START_HEADER, END_HEADER, EOT]

# Llama-3's chat format, as a Jinja template like the ones real checkpoints ship.
LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)


class Tokenizer:
    """Encode, decode and chat-format text for one model folder."""

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in model folder {folder}")
        # Two views of one tokenizer.json: text from users is plain text, so a prompt that
        # contains "<|eot_id|>" can neither inject a control token nor lose it on decode; the chat
        # template's own scaffolding is rendered text whose special-token strings must be parsed.
        self._tok = HFTokenizer.from_file(str(path))
        self._template_tok = HFTokenizer.from_file(str(path))
        self._tok.encode_special_tokens = True
        config_path = folder / "tokenizer_config.json"
        config: dict[str, Any] = (
            json.loads(config_path.read_text()) if config_path.is_file() else {}
        )
        self.bos_token: str = _token_text(config.get("bos_token")) or BOS
        self.chat_template: str = config.get("chat_template") or LLAMA3_CHAT_TEMPLATE
        self._template = jinja2.Environment(autoescape=False).from_string(self.chat_template)
        added = self._template_tok.get_added_tokens_decoder().values()
        self._special_strings = [t.content for t in added if t.special]

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` as plain text (special-token strings in it are not parsed)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Render messages with the model's chat template and encode them (BOS comes from it).

        A message's content is the user's text: one that holds a special-token string (say
        "<|eot_id|>") is rendered through a placeholder and encoded as plain text, so it cannot
        become a control token (role injection). Other content renders in place, exactly as
        transformers' `apply_chat_template` does."""

        def render(messages: list[dict[str, str]]) -> str:
            return self._template.render(
                messages=messages, bos_token=self.bos_token,
                add_generation_prompt=add_generation_prompt,
            )  # fmt: skip

        if not any(self._holds_special(m.get("content")) for m in messages):
            return self._template_tok.encode(render(messages), add_special_tokens=False).ids
        nonce = secrets.token_hex(8)
        contents: list[str] = []
        rendered = []
        for message in messages:
            if self._holds_special(content := message.get("content") or ""):
                message = {**message, "content": f"\x00{nonce}:{len(contents)}\x00"}
                contents.append(content)
            rendered.append(message)
        text = render(rendered)
        ids: list[int] = []
        for i, part in enumerate(re.split(f"\x00{nonce}:(\\d+)\x00", text)):
            if i % 2:  # a placeholder: the content it stands for, as plain text
                ids += self._tok.encode(contents[int(part)], add_special_tokens=False).ids
            else:
                ids += self._template_tok.encode(part, add_special_tokens=False).ids
        return ids

    def _holds_special(self, content: str | None) -> bool:
        """Whether chat content holds a special-token string (which must stay text)."""
        return content is not None and any(s in content for s in self._special_strings)


def _token_text(token: Any) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def synthetic_corpus(seed: int, num_words: int = 120_000) -> list[str]:
    """Seeded pseudo-text: Zipf-distributed made-up words, digits, punctuation, some unicode."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["th", "st", "er", "ing"]
    lexicon = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(6000)]
    lexicon += ["the", "of", "and", "to", "in", "é", "ü", "日本", "数据", "😀", "\n", "  "]
    weights = [1.0 / (rank + 1) for rank in range(len(lexicon))]
    words = rng.choices(lexicon, weights=weights, k=num_words)
    lines, line = [], []
    for i, word in enumerate(words):
        line.append(word.capitalize() if rng.random() < 0.05 else word)
        if rng.random() < 0.03:
            line.append(str(rng.randint(0, 10_000)))
        if i % 17 == 16:
            lines.append(" ".join(line) + rng.choice([".", ",", "?", "!", ";", ":"]))
            line = []
    return lines


def build_byte_level_bpe(vocab_size: int, seed: int) -> HFTokenizer:
    """A byte-level BPE tokenizer with exactly `vocab_size` entries (specials included)."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(seed), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"BPE training reached {tok.get_vocab_size()} tokens, not {vocab_size}")
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return tok
