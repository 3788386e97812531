"""An engine's structured outputs: one `GrammarCompiler`, built on first use, and the matchers of
its requests (each kept on its `Request`, so it goes wherever the request goes and is freed with
it on every path that drops the request)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from common.sampling import SamplingParams
from common.structured.grammar import GrammarCompiler, GrammarMatcher


class EngineGrammars:
    """Builds each request's grammar matcher for one model. The compiler (the llguidance
    tokenizer, from the model folder's `tokenizer.json`) is built when the first request with a
    spec arrives: an engine that never sees one never pays for it."""

    def __init__(self, model_path: str | Path, vocab_size: int, eos_token_ids: Iterable[int]):
        self._model_path = Path(model_path)
        self._vocab_size = vocab_size
        self._eos_token_ids = tuple(eos_token_ids)
        self._compiler: GrammarCompiler | None = None

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

    def num_cached_specs(self) -> int:
        return 0 if self._compiler is None else self._compiler.cached_specs()

    def _compiler_for_model(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler.from_model_folder(
                self._model_path, self._vocab_size, self._eos_token_ids
            )
        return self._compiler
