"""Text prompts that the served model's tokenizer encodes to exactly the requested length.

For servers that take text only, or to load the tokenizer path too. Each prompt is a string of
"words": vocabulary entries that decode to a space and letters and encode back to themselves
alone. A byte-level (GPT-2 / Llama-3) pre-tokenizer splits text before every " letters" run, so a
string of such words encodes word by word, one token each; the tokens the server adds
(`add_special_tokens`: BOS) are counted in. Every prompt is checked by encoding it, and trimmed or
extended a word at a time in the rare case it is off (other pre-tokenizers); what still differs is
reported by the run (`usage_mismatches`). Hash ids keep their meaning: one id is always the same
run of words, so shared prefixes stay shared.

For the chat endpoint the text is one user message and is counted as the server counts a chat:
rendered with the model's chat template (`common.tokenizer`, transformers' rendering), so the
template's own tokens (role headers, a default system prompt) are part of `input_len`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer

from common.tokenizer import Tokenizer as ChatTokenizer
from loadgen.prompts import PromptBuilder
from loadgen.target import RequestSpec

_MIN_WORDS = 64  # a vocabulary with fewer single-token words cannot make varied prompts
_MAX_FIXES = 16  # words added or dropped to correct one prompt's length


def load_tokenizer(path_or_name: str) -> Tokenizer:
    """A model folder, a `tokenizer.json`, or a Hugging Face Hub name (downloaded)."""
    path = Path(path_or_name)
    if path.is_dir():
        path = path / "tokenizer.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    return Tokenizer.from_pretrained(path_or_name)


def tokenizer_folder(path_or_name: str) -> Path:
    """The folder holding `tokenizer.json` and `tokenizer_config.json` (the chat template): a
    model folder, the folder of a `tokenizer.json`, a PhaseMesh preset's folder (`smollm2`, what
    `make run` serves under that name), or those two files of a Hub model."""
    path = Path(path_or_name)
    if path.is_file():
        return path.parent
    if path.is_dir():
        return path
    from common.model.default import PRESETS, default_model_path  # imports torch: only here

    if path_or_name in PRESETS:
        return default_model_path(path_or_name)
    from huggingface_hub import snapshot_download  # only for Hub names

    patterns = ["tokenizer.json", "tokenizer_config.json"]
    return Path(snapshot_download(path_or_name, allow_patterns=patterns))


def chat_token_counter(path_or_name: str) -> Callable[[str], int]:
    """Tokens of a chat whose one user message is `text`, generation prompt included."""
    chat = ChatTokenizer(tokenizer_folder(path_or_name))
    return lambda text: len(chat.apply_chat_template([{"role": "user", "content": text}]))


def text_prompt_builder(path_or_name: str, seed: int, *, chat: bool) -> TextPromptBuilder:
    """Prompts of text for the completions endpoint, or for the chat endpoint (`chat`)."""
    tokenizer = load_tokenizer(str(tokenizer_folder(path_or_name)))
    count = chat_token_counter(path_or_name) if chat else None
    return TextPromptBuilder(tokenizer, seed=seed, count=count)


class TextPromptBuilder:
    """Text prompts of exactly `input_len` tokens as `count` counts them (default: `tokenizer`
    with its special tokens, as a completions server does); deterministic for a given seed and
    tokenizer. `count` may instead count the text as a chat (`chat_token_counter`)."""

    def __init__(
        self, tokenizer: Tokenizer, seed: int = 0, count: Callable[[str], int] | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self._count = count or self._count_with_special_tokens
        self.words = single_token_words(tokenizer)
        if len(self.words) < _MIN_WORDS:
            raise ValueError(f"the tokenizer has only {len(self.words)} single-token words")
        # The ids the server adds around a prompt (BOS, a chat template's scaffolding): a
        # prompt's words are that many fewer.
        self.num_added = self.count("")
        self._indices = PromptBuilder(vocab_size=len(self.words), seed=seed, low_id=0)

    def prompt(self, spec: RequestSpec) -> str:
        """The request's `prompt` field: text of `spec.input_len` tokens."""
        num_words = max(1, spec.input_len - self.num_added)
        sized = RequestSpec(spec.req_index, spec.arrival_s, num_words, spec.output_len,
                            spec.hash_ids, spec.block_len)  # fmt: skip
        words = [self.words[i] for i in self._indices.prompt_ids(sized)]
        return self._fit(words, spec)

    def count(self, text: str) -> int:
        """Tokens the server counts for `text` as this builder's prompt."""
        return self._count(text)

    def _count_with_special_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def _fit(self, words: list[str], spec: RequestSpec) -> str:
        """Drop or add words until the text encodes to `input_len` tokens (or give up)."""
        for fix in range(_MAX_FIXES):
            off = self.count("".join(words)) - spec.input_len
            if off == 0 or (off < 0 and len(words) == 0):
                break
            if off > 0 and len(words) > 1:
                words.pop()
            elif off < 0:
                words.append(self.words[(spec.req_index + fix) % len(self.words)])
            else:
                break
        return "".join(words)


def single_token_words(tokenizer: Tokenizer) -> list[str]:
    """Vocabulary entries that decode to " " + ASCII letters and encode back to that one id,
    in id order (so a tokenizer always gives the same list)."""
    words = []
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=False)):
        text = tokenizer.decode([token_id])
        if len(text) < 3 or text[0] != " " or not (text[1:].isascii() and text[1:].isalpha()):
            continue
        if text in special:
            continue
        if tokenizer.encode(text, add_special_tokens=False).ids == [token_id]:
            words.append(text)
    return words
