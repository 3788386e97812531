"""A fake engine that costs nothing, behind the real router: the front end's own ceiling.

`NullEngineFake` has the surface `InProcessEngineClient` drives (`add_request`, `step`, `abort`,
`has_unfinished`, `requests`, `blocks`, `max_model_len`) and emits one token per running request
per step, with no model and no KV. Its steps are paced (a sleep: no CPU, no GIL) so that it offers
tokens at a given rate, by default the in-process engine's at the same batch size: served through
the real `Router`, `InProcessEngineClient`, Serve and HTTP, what reaches the clients is then all
the front end can pass of the engine's rate, on the cores left to it with no engine computing.

`build_app` is a serve config's `import_path` (`bench.null_engine:build_app`, written by
`bench/serve.py`'s `ceiling` path): one Router deployment, as `services.app.RouterDeployment` is
for `topology: local`, with this engine in place of `LLMEngine`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray import serve

from common.config import ModelConfig
from common.engine.request import FinishReason, RequestOutput, check_prompt
from common.model.default import default_model_path
from common.sampling import SamplingParams
from services.router.engine_client import InProcessEngineClient
from services.router.server import Router
from services.router.streams import AdmissionLimits

FAKE_TOKEN_ID = 8  # a plain token of the tiny vocabularies; its text is FAKE_TEXT
FAKE_TEXT = " a"


@dataclass
class _FakeRequest:
    num_prompt_tokens: int
    max_tokens: int
    num_output_tokens: int = 0


@dataclass(frozen=True)
class _NoBlocks:
    """`LLMEngine.blocks` as `/stats` reads it: no KV at all."""

    num_used_blocks: int = 0
    num_blocks: int = 0


class NullEngineFake:
    """Zero-compute stand-in for `LLMEngine`: one token per running request per step.

    `rates_tok_s`: tokens/s to offer at each batch size (the step for `n` running requests lasts
    `n / rate` of the batch size nearest `n`), times `speedup`; empty: no pacing (a step per
    loop, which then competes with the router for the GIL)."""

    def __init__(
        self,
        model_path: Path,
        rates_tok_s: dict[int, float] | None = None,
        speedup: float = 1.0,
    ) -> None:
        config = ModelConfig.from_folder(model_path)
        self.vocab_size = config.vocab_size
        self.max_model_len = config.max_position_embeddings
        self.rates_tok_s = {int(b): float(r) * speedup for b, r in (rates_tok_s or {}).items()}
        self.requests: dict[str, _FakeRequest] = {}
        self.blocks = _NoBlocks()
        self.tokenizer = None  # its outputs carry their own text (FAKE_TEXT): the router makes none
        self._next_step_at = time.monotonic()

    def add_request(
        self, req_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None
    ) -> None:
        """The real engine's checks that need no model: a reused id, an empty or long prompt."""
        if req_id in self.requests:
            raise ValueError(f"request id {req_id} is already in use")
        check_prompt(list(prompt_token_ids), self.vocab_size, self.max_model_len)
        max_tokens = (params or SamplingParams()).max_tokens
        self.requests[req_id] = _FakeRequest(len(prompt_token_ids), max_tokens)

    def abort(self, req_id: str) -> bool:
        return self.requests.pop(req_id, None) is not None

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self._pace(len(self.requests))
        outputs = []
        for req_id, req in list(self.requests.items()):
            req.num_output_tokens += 1
            done = req.num_output_tokens >= req.max_tokens
            outputs.append(RequestOutput(
                req_id, [FAKE_TOKEN_ID], FAKE_TEXT, FinishReason.LENGTH if done else None,
                req.num_prompt_tokens, req.num_output_tokens,
            ))  # fmt: skip
            if done:
                del self.requests[req_id]
        return outputs

    def _pace(self, num_running: int) -> None:
        """Sleep until this step is due: the offered rate, whatever the loop around costs."""
        if not self.rates_tok_s or not num_running:
            return
        nearest = min(self.rates_tok_s, key=lambda b: abs(b - num_running))
        now = time.monotonic()
        # NOTE: a step late (the router held the GIL) is not made up by a burst: the next one
        # is due a full step after this one.
        self._next_step_at = max(self._next_step_at, now) + num_running / self.rates_tok_s[nearest]
        time.sleep(max(0.0, self._next_step_at - now))


@serve.deployment(name="Router", max_ongoing_requests=512)
@serve.ingress()
class NullEngineRouter:
    """The real `Router` over `InProcessEngineClient(NullEngineFake)`."""

    def __init__(self, args: dict[str, Any]) -> None:
        model_path = default_model_path(args.get("model", "tiny"))
        rates = {int(b): float(r) for b, r in args.get("rates_tok_s", {}).items()}
        engine = NullEngineFake(model_path, rates, float(args.get("speedup", 1.0)))
        self.client = InProcessEngineClient(engine)  # type: ignore[arg-type]
        self.router = Router(self.client, model_path, args.get("served_model_name"))

    def __serve_build_asgi_app__(self) -> Any:
        return self.router.app

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """The serve config's admission bounds, as `services.app.RouterDeployment` applies them."""
        self.client.streams.limits = AdmissionLimits(**user_config)

    def __del__(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.shutdown()


def build_app(args: dict[str, Any]) -> serve.Application:
    return NullEngineRouter.bind(args)  # type: ignore[attr-defined]
