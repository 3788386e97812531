"""An engine's structured outputs: one `GrammarCompiler`, built on first use, and the matchers of
its requests (each kept on its `Request`, so it goes wherever the request goes and is freed with
it on every path that drops the request).

Compiling a new spec takes from a millisecond to tens of them (bounded at the router,
`common.structured.spec`): on the engine's loop, every batch-mate would wait for it. An engine
service holds such a request's message in `GrammarWaits` while a small pool compiles its spec,
and hands it to the engine once `EngineGrammars.matcher` will find the spec compiled.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Generic, TypeVar

from common.sampling_params import SamplingParams
from common.structured.grammar import GrammarCompiler, GrammarMatcher
from common.wake_pipe import WakePipe

COMPILE_THREADS = 2  # specs compiled at once per engine (llguidance releases the GIL meanwhile)

Message = TypeVar("Message")


class EngineGrammars:
    """Builds each request's grammar matcher for one model. The compiler (the llguidance
    tokenizer, from the model folder's `tokenizer.json`) is built when the first request with a
    spec arrives: an engine that never sees one never pays for it."""

    def __init__(self, model_path: str | Path, vocab_size: int, eos_token_ids: Iterable[int]):
        self._model_path = Path(model_path)
        self._vocab_size = vocab_size
        self._eos_token_ids = tuple(eos_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def matcher(
        self, params: SamplingParams, output_token_ids: Iterable[int] = ()
    ) -> GrammarMatcher | None:
        """The request's matcher after its output so far (a migrated or handed-off request
        replays its tokens), or None without a spec. Raises ValueError, naming the parameter, if
        the spec does not compile here or the tokens do not follow it: that request alone fails.
        """
        spec = params.structured_output
        if spec is None:
            return None
        try:
            return self._compiler_for_model().matcher(spec, output_token_ids)
        except Exception as exc:  # noqa: BLE001 - llguidance's errors are the request's fault
            raise ValueError(f"invalid sampling parameter structured_output: {exc}") from exc

    def is_ready(self, spec: str | None) -> bool:
        """Whether `matcher` would compile nothing for `spec`: none, or one compiled (or refused)
        already."""
        if spec is None:
            return True
        compiler = self._compiler
        return compiler is not None and compiler.is_cached(spec)

    def compile_async(self, spec: str) -> Future[None]:
        """Compile `spec` (and the compiler, the first time) on this engine's compile pool; done
        when `is_ready(spec)`. A spec that does not compile is done too (`matcher` says why)."""
        with self._compiler_lock:  # the engine's loop or a router's event loop may ask first
            if self._pool is None:
                self._pool = ThreadPoolExecutor(COMPILE_THREADS, "grammar-compile")
        return self._pool.submit(self._compile, spec)

    def num_cached_specs(self) -> int:
        return 0 if self._compiler is None else self._compiler.cached_specs()

    def _compile(self, spec: str) -> None:
        try:
            compiler = self._compiler_for_model()
        except Exception:  # noqa: BLE001 - `matcher` raises it again, for the request
            return
        compiler.compile(spec)

    def _compiler_for_model(self) -> GrammarCompiler:
        with self._compiler_lock:  # the compile pool and the engine's loop may both ask first
            if self._compiler is None:
                self._compiler = GrammarCompiler.from_model_folder(
                    self._model_path, self._vocab_size, self._eos_token_ids
                )
            return self._compiler


class GrammarWaits(Generic[Message]):
    """Messages held while their request's spec compiles off the engine's loop.

    `hold` keeps a message whose spec is not compiled yet and starts its compile; `ready` gives
    back, in the order they finished, those whose compile is done; `drop` forgets one (its request
    was aborted meanwhile). `fileno` becomes readable when one is ready, for the loop's poller:
    the loop sleeps in its poll, never polls with a sleep. Used from one thread (the loop's);
    compiles finish on the pool's."""

    def __init__(self, grammars: EngineGrammars) -> None:
        self._grammars = grammars
        self._held: dict[str, Message] = {}
        self._finished: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._wake = WakePipe()

    def fileno(self) -> int:
        return self._wake.fileno()

    def hold(self, req_id: str, spec: str | None, message: Message) -> bool:
        """True if `message` is held until `spec` compiles (then `ready` returns it); False if
        it can go on now (no spec, compiled already, or a request id already held)."""
        if self._grammars.is_ready(spec) or req_id in self._held:
            return False
        assert spec is not None
        self._held[req_id] = message
        self._grammars.compile_async(spec).add_done_callback(lambda _: self._done(req_id))
        return True

    def ready(self) -> list[Message]:
        """The held messages whose spec has compiled since the last call."""
        self._wake.clear()
        out: list[Message] = []
        while True:
            try:
                req_id = self._finished.get_nowait()
            except queue.Empty:
                return out
            message = self._held.pop(req_id, None)
            if message is not None:
                out.append(message)

    def drop(self, req_id: str) -> bool:
        """Forget a held message; False if none was held for `req_id`."""
        return self._held.pop(req_id, None) is not None

    def num_held(self) -> int:
        return len(self._held)

    def close(self) -> None:
        self._wake.close()

    def _done(self, req_id: str) -> None:
        # On a compile thread (or this one, for a compile already done).
        self._finished.put(req_id)
        self._wake.wake()  # after `close`: nobody is left to wake
