"""llama.cpp's side of bench/engine.py: runs in the bench's own environment (.venv-llamacpp,
bench/llamacpp_env.sh), never in the project's. It imports llama-cpp-python's low-level API,
numpy and the standard library only.

    .venv-llamacpp/bin/python bench/llamacpp_worker.py --threads 2

reads one JSON request a line on stdin and answers each with one JSON line on stdout:

    {"gguf": PATH, "prompts": [[token ids], ...], "new_tokens": N}
    -> {"seconds": S, "tokens": [[N token ids], ...], "context": {...}}

Every prompt is a sequence of its own in one context (`n_seq_max` = the prompt count: llama.cpp's
parallel slots); the prompts are prefilled in one `llama_decode`, then each decode step is one
`llama_decode` of one token per sequence, the next tokens greedy (the argmax of the logits the
step wrote). N tokens: one from the prefill, N - 1 decode steps, as PhaseMesh's `max_tokens=N`.
`seconds` is the wall time of prefill and decode, not of the pipe. A model is loaded once per
file; its context is made again when the prompt count changes. Anything wrong (a file that does
not load, a decode that fails) answers {"error": "..."} and the worker goes on with the next line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import llama_cpp as lc  # type: ignore[import-not-found]
import numpy as np

SEQ_CELLS = 256  # KV cells per sequence: the bench's prompts (<= 128) and outputs (<= 64) fit


class Side:
    """One GGUF file's model and a context with as many sequences as the last request had."""

    def __init__(self, path: str, threads: int) -> None:
        params = lc.llama_model_default_params()
        params.n_gpu_layers = 0
        self.model = lc.llama_model_load_from_file(path.encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.threads = threads
        self.ctx: Any = None
        self.n_seq = 0
        self.batch: Any = None
        self.capacity = 0

    def context(self, n_seq: int, n_tokens: int) -> Any:
        if self.ctx is None or self.n_seq != n_seq:
            if self.ctx is not None:
                lc.llama_free(self.ctx)
            params = lc.llama_context_default_params()
            params.n_ctx = params.n_batch = SEQ_CELLS * n_seq
            params.n_seq_max = n_seq
            params.n_threads = params.n_threads_batch = self.threads
            self.ctx = lc.llama_init_from_model(self.model, params)
            if not self.ctx:
                raise RuntimeError(f"llama.cpp could not make a context of {n_seq} sequences")
            self.n_seq, self.params = n_seq, params
        if self.capacity < n_tokens:
            if self.batch is not None:
                lc.llama_batch_free(self.batch)
            self.batch, self.capacity = lc.llama_batch_init(n_tokens, 0, 1), n_tokens
        return self.ctx

    def describe(self) -> dict[str, Any]:
        p = self.params
        return {
            "n_seq_max": p.n_seq_max, "n_ctx": p.n_ctx, "n_threads": p.n_threads,
            "flash_attn_type": p.flash_attn_type, "type_k": p.type_k, "kv_unified": p.kv_unified,
        }  # fmt: skip

    def fill(self, rows: list[tuple[int, int, int, bool]]) -> None:
        """The batch: (token, position, sequence, logits wanted) a row."""
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
            b.seq_id[i][0], b.logits[i] = seq, logits
        b.n_tokens = len(rows)

    def greedy(self, ctx: Any, n: int) -> list[int]:
        """The argmax of each of the `n` logit rows the last decode wrote (in batch order)."""
        logits = np.ctypeslib.as_array(lc.llama_get_logits(ctx), shape=(n, self.vocab))
        return logits.argmax(axis=1).tolist()

    def decode(self, ctx: Any) -> None:
        status = lc.llama_decode(ctx, self.batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
        n = len(prompts)
        ctx = self.context(n, max(sum(map(len, prompts)), n))
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        prefill = [
            (token, pos, seq, pos == len(prompt) - 1)
            for seq, prompt in enumerate(prompts)
            for pos, token in enumerate(prompt)
        ]
        start = time.perf_counter()
        self.fill(prefill)
        self.decode(ctx)
        nxt = self.greedy(ctx, n)
        out = [[t] for t in nxt]
        for step in range(new_tokens - 1):
            self.fill([(nxt[s], len(prompts[s]) + step, s, True) for s in range(n)])
            self.decode(ctx)
            nxt = self.greedy(ctx, n)
            for s in range(n):
                out[s].append(nxt[s])
        return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, required=True)
    args = parser.parse_args()
    lc.llama_backend_init()
    sides: dict[str, Side] = {}
    print(json.dumps({"ready": lc.__version__, "system": lc.llama_print_system_info().decode()}))
    sys.stdout.flush()
    for line in sys.stdin:
        try:
            request = json.loads(line)
            path = request["gguf"]
            if path not in sides:
                sides[path] = Side(path, args.threads)
            side = sides[path]
            seconds, tokens = side.generate(request["prompts"], int(request["new_tokens"]))
            answer: dict[str, Any] = {"seconds": seconds, "tokens": tokens}
            answer["context"] = side.describe()
        except Exception as exc:  # noqa: BLE001 (one bad request is answered, not fatal)
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
