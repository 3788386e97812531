"""Grammar engines compared (how docs/structured_outputs.md chose llguidance).

    PYTHONPATH=. .venv/bin/python bench/grammar_engines.py [--vocabs 2048 32768 131072]

For xgrammar, llguidance and outlines-core (whichever are installed; only llguidance is a
dependency), per vocabulary size and JSON schema: the time to compile the schema and build a
matcher, and the mean per-token time to fill the next-token bitmask and to accept the sampled
token, over up to 200 tokens sampled from seeded random logits under the mask (the same draws
for every engine; a bias toward JSON punctuation keeps the walk moving through structure).
Vocabulary 2048 is the default model's tokenizer; larger ones are byte-level BPEs trained here.
The last line is one JSON object with every figure, `targets` and `targets_met`: the reasons
docs/structured_outputs.md gives for llguidance, held against its own figures (a schema's matcher
built in about the same time whatever the vocabulary; a fill per token within the mask budget
`bench/structured.py` holds the whole mask to). A target the run cannot judge (one vocabulary
only, llguidance not installed) is `null`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if sys.path[0] == str(Path(__file__).resolve().parent):  # bench/profile.py shadows `profile`
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import numpy as np  # noqa: E402
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402

from bench.structured import SCHEMAS, trained_tokenizer_json  # noqa: E402
from common.model.default import default_model_path  # noqa: E402
from common.tokenizer import EOS  # noqa: E402

MAX_TOKENS = 200
TARGETS = {
    # llguidance's build at the largest vocabulary over its build at the smallest, per schema.
    "llguidance_compile_vocab_growth": 2.0,
    # Its mean fill per token, every vocabulary and schema: bench/structured.py's mask budget.
    "llguidance_fill_us_max": 50.0,
}
Engine = tuple[Callable[[dict], Any], Callable[[Any, np.ndarray], None], Callable[[Any, int], Any]]


def byte_level_bytes() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def xgrammar_engine(text: str, tok: HFTokenizer, eos: int) -> Engine:
    import torch
    import xgrammar as xgr

    vocab = tok.get_vocab(with_added_tokens=True)
    encoded = [""] * len(vocab)
    for piece, token_id in vocab.items():
        encoded[token_id] = piece
    info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    return (
        lambda s: xgr.GrammarMatcher(compiler.compile_json_schema(s, any_whitespace=False)),
        lambda m, bm: m.fill_next_token_bitmask(torch.from_numpy(bm)),
        lambda m, t: m.accept_token(t),
    )


def llguidance_engine(text: str, tok: HFTokenizer, eos: int) -> Engine:
    import llguidance as llg

    lltok = llg.LLTokenizer(text, eos_token=eos)
    options: Any = {"whitespace_flexible": False}
    return (
        lambda s: llg.LLMatcher(lltok, llg.LLMatcher.grammar_from_json_schema(s, options)),
        lambda m, bm: m.unsafe_compute_mask_ptr(bm.ctypes.data, bm.nbytes),
        lambda m, t: m.consume_token(t),
    )


def outlines_engine(text: str, tok: HFTokenizer, eos: int) -> Engine:
    import outlines_core as oc

    to_byte = byte_level_bytes()
    special = {t.content for t in tok.get_added_tokens_decoder().values()}
    pieces: dict[bytes, list[int]] = {}
    for piece, token_id in tok.get_vocab(with_added_tokens=True).items():
        if piece not in special:
            pieces.setdefault(bytes(to_byte[c] for c in piece), []).append(token_id)
    vocabulary = oc.Vocabulary(eos, pieces)
    return (
        lambda s: oc.Guide(
            oc.Index(oc.json_schema.build_regex_from_schema(json.dumps(s)), vocabulary)
        ),
        lambda m, bm: m.write_mask_into(bm.ctypes.data, bm.size, 4),
        lambda m, t: m.advance(t) is not None,
    )


ENGINES = {"xgrammar": xgrammar_engine, "llguidance": llguidance_engine}
ENGINES["outlines-core"] = outlines_engine
MODULES = {"xgrammar": "xgrammar", "llguidance": "llguidance", "outlines-core": "outlines_core"}


def walk(engine: Engine, schema: dict, bias: np.ndarray, eos: int) -> dict[str, Any]:
    make, fill, accept = engine
    n = bias.size
    bitmask = np.zeros((1, (n + 31) // 32), dtype=np.int32)
    start = time.perf_counter()
    matcher = make(schema)
    compile_s = time.perf_counter() - start
    rng = np.random.default_rng(0)
    fill_s = accept_s = 0.0
    count = 0
    while count < MAX_TOKENS:
        count += 1
        start = time.perf_counter()
        fill(matcher, bitmask)
        fill_s += time.perf_counter() - start
        allowed = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:n].astype(bool)
        logits = np.where(allowed, rng.standard_normal(n) + bias, -np.inf)
        token = int(logits.argmax())
        if token == eos:  # the end (outlines-core refuses EOS in a final state)
            break
        start = time.perf_counter()
        accept(matcher, token)
        accept_s += time.perf_counter() - start
    return {
        "compile_ms": round(compile_s * 1e3, 2), "fill_us": round(fill_s / count * 1e6, 1),
        "accept_us": round(accept_s / count * 1e6, 1), "tokens": count,
    }  # fmt: skip


def punctuation_bias(tok: HFTokenizer, eos: int) -> np.ndarray:
    bias = np.zeros(tok.get_vocab_size(with_added_tokens=True))
    for piece, token_id in tok.get_vocab(with_added_tokens=True).items():
        if all(c in '"{}[],:0123456789.-' for c in piece):
            bias[token_id] = 4.0
    bias[eos] = 4.0
    return bias


def targets_met(results: dict[str, Any], vocabs: list[int]) -> dict[str, bool | None]:
    """One verdict per target from llguidance's rows (`None` where the run cannot tell); records
    the compile growth in `results`."""
    rows = {k: v for k, v in results.items() if k.split("/")[1] == "llguidance"}
    fills = [row["fill_us"] for row in rows.values()]
    growth = None
    if len(set(vocabs)) > 1 and rows:
        low, high = min(vocabs), max(vocabs)
        growth = max(
            rows[f"{high}/llguidance/schema{i}"]["compile_ms"]
            / max(rows[f"{low}/llguidance/schema{i}"]["compile_ms"], 0.01)
            for i in range(len(SCHEMAS))
        )
        results["llguidance_compile_vocab_growth"] = round(growth, 2)
    return {
        "llguidance_compile_vocab_growth": (
            None if growth is None else growth <= TARGETS["llguidance_compile_vocab_growth"]
        ),
        "llguidance_fill_us_max": max(fills) <= TARGETS["llguidance_fill_us_max"]
        if fills
        else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocabs", type=int, nargs="+", default=[2048, 32768, 131072])
    args = parser.parse_args()
    results: dict[str, Any] = {}
    installed = {n: f for n, f in ENGINES.items() if importlib.util.find_spec(MODULES[n])}
    for vocab in args.vocabs:
        if vocab == 2048:
            text = (default_model_path() / "tokenizer.json").read_text()
        else:
            text = trained_tokenizer_json(vocab)
        tok = HFTokenizer.from_str(text)
        eos = tok.token_to_id(EOS)
        bias = punctuation_bias(tok, eos)
        for name, build in installed.items():
            engine = build(text, tok, eos)
            for i, schema in enumerate(SCHEMAS):
                figures = walk(engine, schema, bias, eos)
                results[f"{vocab}/{name}/schema{i}"] = figures
                print(f"vocab {vocab:6d} {name:13s} schema {i}: {figures}", flush=True)
    met = targets_met(results, args.vocabs)
    print(json.dumps(results | {"targets": TARGETS, "targets_met": met}))


if __name__ == "__main__":
    main()
