"""Tokenizer: a Hugging Face `tokenizer.json` plus the chat template from `tokenizer_config.json`.

`build_byte_level_bpe` makes the default model's tokenizer: byte-level BPE, so any UTF-8 text
round-trips, trained on a seeded synthetic corpus so that building it needs no download.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFTokenizer

from common.chat_template import (
    MARK_END,
    MARK_START,
    ChatTemplateError,
    control_pattern,
    literal_text,
    mark_control_tokens,
    marker_pattern,
    render,
    special_tokens_map,
)

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
        self.special_tokens = special_tokens_map(config) or {"bos_token": BOS}
        self.bos_token: str = self.special_tokens.get("bos_token", BOS)
        self.chat_template: str = config.get("chat_template") or LLAMA3_CHAT_TEMPLATE
        added = list(self._template_tok.get_added_tokens_decoder().values())
        self._control = control_pattern(_control_tokens(added, config, self.chat_template))
        self._markers = marker_pattern(t.content for t in added)
        self._newline_ids = self._template_tok.encode("\n", add_special_tokens=False).ids
        spec = json.loads(path.read_text())
        vocab = self._tok.get_vocab(with_added_tokens=True)
        # None: a token may stand for any length of text (an unknown word), so no bound.
        self.max_token_bytes = _max_token_bytes(vocab) if _covers_bounded_text(spec) else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` as plain text (special-token strings in it are not parsed)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_long(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`encode`'s ids, computed without holding the GIL (tokenizers' batch call releases it,
        its single one does not): for a long text on a worker thread, so that the event loop
        runs meanwhile."""
        (encoding,) = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)
        return encoding.ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary string of an id (byte-level BPE spells a space "Ġ")."""
        return self._tok.id_to_token(token_id) or ""

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The chat as the template renders it (with OpenAI's `tools`, if given), control
        tokens in user text marked (`common.chat_template`); `ChatTemplateError` when the
        template refuses it."""
        if any(map(self._holds_control, (messages, template_kwargs, tools))):
            messages = mark_control_tokens(messages, self._control)
            template_kwargs = mark_control_tokens(template_kwargs, self._control)
            tools = mark_control_tokens(tools, self._control)
        return render(
            self.chat_template, messages, self.special_tokens,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, template_kwargs=template_kwargs,
            tools=tools,
        )  # fmt: skip

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Render messages with the model's chat template and encode them (BOS comes from it):
        transformers' `apply_chat_template(..., tokenize=True, sanitize_control_tokens=True)`.

        A control-token string in a message (say "<|eot_id|>") is encoded as plain text, so it
        cannot become a control token (role injection); everything else is transformers'."""
        text = self.render_chat(
            messages, add_generation_prompt, continue_final_message, template_kwargs, tools
        )
        return self.encode_rendered_chat(text)

    def encode_rendered_chat(self, text: str) -> list[int]:
        """Ids of a rendered chat: template text with its control tokens parsed, marked tokens as
        plain text (transformers' `encode_marked_chat`). Pieces after the first are encoded
        behind a newline that is then dropped, so a piece encodes as it would mid-text."""
        pieces = self._markers.split(text)
        ids = self._template_tok.encode(pieces[0], add_special_tokens=False).ids
        for i, piece in enumerate(pieces[1:], start=1):
            if not piece:  # a lone marker (None) or nothing between two markers
                continue
            as_text = i % 2 == 1  # odd pieces are marked tokens from user text
            piece_ids = self._encode_piece(piece, as_text)
            if as_text and self._template_tok.token_to_id(piece) in piece_ids:
                # The model's own vocabulary spells the token: it cannot be kept as text.
                raise ChatTemplateError(f"cannot keep {piece!r} as text in a chat message")
            ids += piece_ids
        return ids

    def _encode_piece(self, piece: str, as_text: bool) -> list[int]:
        encode = self._encode_without_added_tokens if as_text else self._encode_template_text
        ids = encode("\n" + piece)
        if ids[: len(self._newline_ids)] == self._newline_ids:
            return ids[len(self._newline_ids) :]
        return encode(piece)

    def _encode_template_text(self, text: str) -> list[int]:
        return self._template_tok.encode(text, add_special_tokens=False).ids

    def _encode_without_added_tokens(self, text: str) -> list[int]:
        """`text` through the normalizer, pre-tokenizer and model alone: no added token, special
        or not, can match (`encode_special_tokens` only skips the special ones)."""
        tok = self._template_tok
        if tok.normalizer is not None:
            text = tok.normalizer.normalize_str(text)
        splits = [text]
        if tok.pre_tokenizer is not None:
            splits = [split for split, _ in tok.pre_tokenizer.pre_tokenize_str(text)]
        return [token.id for split in splits for token in tok.model.tokenize(split)]

    def _holds_control(self, obj: Any) -> bool:
        """Whether any string in `obj` holds a control token or a marker (both are rewritten)."""
        if isinstance(obj, str):
            return bool(self._control.search(obj)) or MARK_START in obj or MARK_END in obj
        if isinstance(obj, dict):
            return any(self._holds_control(v) for v in obj.values())
        if isinstance(obj, list | tuple):
            return any(self._holds_control(v) for v in obj)
        return False


# Normalizers and pre-tokenizers that never drop or shrink text: after them, every byte of the
# input is still there to be covered by some token (Prepend and Replace only add or swap).
_KEEPING_STEPS = {None, "Prepend", "Replace", "ByteLevel", "Metaspace", "Digits",
                  "Punctuation", "Split", "UnicodeScripts"}  # fmt: skip


def _covers_bounded_text(spec: dict[str, Any]) -> bool:
    """Whether each token of this tokenizer stands for a bounded piece of the input: a BPE model
    with no unknown token to swallow unknown text (or byte fallback instead), and no step before
    it that drops text (a whitespace pre-tokenizer, a stripping normalizer) or shrinks it."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or (model.get("unk_token") and not model.get("byte_fallback")):
        return False
    return all(_keeps_text(spec.get(part)) for part in ("normalizer", "pre_tokenizer"))


def _keeps_text(step: dict[str, Any] | None) -> bool:
    if step is None:
        return True
    kind = step.get("type")
    if kind == "Sequence":
        inner = step.get("normalizers") or step.get("pre_tokenizers") or []
        return all(_keeps_text(s) for s in inner)
    if kind == "Split":
        return step.get("behavior") != "Removed"
    if kind == "Replace":
        pattern, content = step.get("pattern") or {}, step.get("content", "")
        return "String" in pattern and len(content.encode()) >= len(pattern["String"].encode())
    return kind in _KEEPING_STEPS


def _max_token_bytes(vocab: dict[str, int]) -> int:
    """At most how many input bytes one token stands for: its vocabulary string's UTF-8 length,
    which is never less (byte-level BPE writes each byte as one character, SentencePiece a space
    as "▁", byte fallback a byte as "<0x..>")."""
    return max(len(token.encode()) for token in vocab)


def _control_tokens(added: list[AddedToken], config: dict[str, Any], template: str) -> list[str]:
    """The tokens user text may not produce (transformers' rule): every special added token, and
    the other added tokens the config names (`chat_control_tokens`) or, if it names none, those
    the template writes itself (whitespace tokens aside: templates write those as text)."""
    named = config.get("chat_control_tokens")
    if named is not None:
        return [t.content for t in added if t.special or t.content in set(named)]
    literals = literal_text(template)
    return [
        t.content for t in added
        if t.special or (t.content in literals and not t.content.isspace())
    ]  # fmt: skip


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
