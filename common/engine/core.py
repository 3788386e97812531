"""The single-process engine: scheduler + model runner + sampler, stepped in a loop.

Every service reuses these parts; this class is also the reference the disaggregated mesh is
compared against token for token.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

import structlog
import torch

from common.attention import select_backend
from common.block_manager import BlockManager
from common.config import (
    CacheConfig,
    EngineConfig,
    KvCacheDtype,
    ModelConfig,
    SchedulerConfig,
    cache_dir,
)
from common.device import resolve_device
from common.engine.grammars import EngineGrammars
from common.engine.request import FinishReason, Request, RequestOutput, check_prompt
from common.engine.runner import Inputs, ModelRunner, StepInputs
from common.kv_cache import KVCache
from common.model.loader import load_model
from common.protocol import LoadReport, TokenLogprobs
from common.roles import Role
from common.sampling import SampledRow, Sampler, takes_raw_argmax
from common.sampling_params import SamplingParams
from common.scheduling.batching import Batch, EngineScheduler, Phase, Sequence
from common.telemetry.engine_counts import EngineHistograms, engine_counters
from common.telemetry.metrics import ITERATION_TOKENS
from common.tokenizer import Tokenizer

log = structlog.get_logger(__name__)


class LLMEngine:
    """Continuous batching on one process: `add_request`, then `step` until nothing is left."""

    def __init__(
        self, config: EngineConfig, with_tokenizer: bool = True, decode_graphs: bool | None = None
    ) -> None:
        """`decode_graphs`: replay decode steps from CUDA graphs (None: on a CUDA device; True on
        the CPU runs the same padded steps eagerly, for tests)."""
        self.config = config
        self.device = resolve_device(config.device)  # decided once: nothing per step asks again
        self.model = load_model(config.model_path, config.dtype, device=self.device,
                                weight_cache=cache_dir(config.weight_cache))  # fmt: skip
        self.model_config: ModelConfig = self.model.config
        folder = Path(config.model_path)
        self.tokenizer = Tokenizer(folder) if with_tokenizer else None
        c = config.cache
        # Token ids are the model's: the cache namespace is the model's folder name.
        self.blocks = BlockManager(
            c.num_blocks, c.block_size, c.enable_prefix_caching, cache_namespace=folder.name
        )
        mc = self.model_config
        kv_dtype = mc.dtype if c.kv_cache_dtype == "auto" else c.kv_cache_dtype
        if kv_dtype != mc.dtype and self.device.type != "cpu":
            raise ValueError(f"kv_cache_dtype {kv_dtype} under a {mc.dtype} model runs on the "
                             f"CPU only; on {self.device} use auto")  # fmt: skip
        graphs = self.device.type == "cuda" if decode_graphs is None else decode_graphs
        kv = KVCache(
            mc.num_hidden_layers,
            c.num_blocks + graphs,  # the graphs' padding rows write to one block past the rest
            c.block_size,
            mc.num_key_value_heads,
            mc.head_dim,
            getattr(torch, kv_dtype),
            self.device,
        )
        backend = select_backend(config.attention_backend, self.device)
        self.runner: ModelRunner[StepInputs] = ModelRunner(self.model, kv, self.blocks, backend)
        if graphs:
            max_blocks = -(-self.max_model_len // c.block_size)
            self.runner.use_graphs(c.num_blocks, max_blocks, capture=self.device.type == "cuda")
        self.scheduler = EngineScheduler(self.blocks, config.scheduler)
        self.sampler = Sampler()
        self.grammars = EngineGrammars(folder, self.model_config.vocab_size,
                                       self.model_config.eos_token_ids)  # fmt: skip
        self.requests: dict[str, Request] = {}
        self.histograms = EngineHistograms()  # tokens per forward (`load_report`)
        log.info("engine ready", attention=backend.name, kv_blocks=c.num_blocks,
                 kv_dtype=kv_dtype, device=str(self.device))  # fmt: skip
        if self.max_model_len < self.model_config.max_position_embeddings:
            log.warning("the KV cache holds less than the model's context: requests are capped",
                        max_model_len=self.max_model_len,
                        model_context=self.model_config.max_position_embeddings)  # fmt: skip

    @classmethod
    def from_path(
        cls,
        model_path: str | Path,
        num_blocks: int = 1024,
        block_size: int = 16,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 64,
        attention_backend: str = "auto",
        enable_prefix_caching: bool = True,
        max_preemptions: int = 2,
        starvation_s: float = 1.0,
        device: str = "auto",
        num_scheduler_steps: int = 1,
        kv_cache_dtype: KvCacheDtype = "auto",
    ) -> LLMEngine:
        """`device`: auto | cpu | cuda[:N] (common/device.py; auto: CUDA when there is one);
        `kv_cache_dtype`: auto (the model's) | float32 | bfloat16 (`CacheConfig`)."""
        return cls(
            EngineConfig(
                model_path=str(model_path),
                cache=CacheConfig(block_size, num_blocks, enable_prefix_caching, kv_cache_dtype),
                scheduler=SchedulerConfig(
                    max_num_batched_tokens,
                    max_num_seqs,
                    max_preemptions,
                    starvation_s,
                    num_scheduler_steps,
                ),
                attention_backend=attention_backend,
                device=device,
            )
        )

    @property
    def max_model_len(self) -> int:
        """The longest context a request may reach: the model's, or less when this engine's KV
        cache holds less (a request alone must always fit: it could never be preempted into room,
        and would be preempted forever)."""
        c = self.config.cache
        return min(self.model_config.max_position_embeddings, c.num_blocks * c.block_size)

    def add_request(
        self, req_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None
    ) -> None:
        """Queue a request. Raises ValueError for an empty or over-long prompt, a reused id or a
        structured-output spec that does not compile (nothing is queued then)."""
        if req_id in self.requests:
            raise ValueError(f"request id {req_id} is already in use")
        check_prompt(list(prompt_token_ids), self.model_config.vocab_size, self.max_model_len)
        params = params or SamplingParams()
        params.check_vocab(self.model_config.vocab_size)
        self.requests[req_id] = Request(
            req_id,
            list(prompt_token_ids),
            params,
            self.model_config.eos_token_ids,
            self.max_model_len,
            grammar=self.grammars.matcher(params),
        )
        # Prompt logprobs need every prompt position's logits: such a prompt computes them all.
        wants_all = self.requests[req_id].prompt_logprobs_wanted is not None
        reusable = None if wants_all else list(prompt_token_ids)
        self.scheduler.add(Sequence(req_id, len(prompt_token_ids), token_ids=reusable,
                                    priority=params.priority))  # fmt: skip

    def abort(self, req_id: str) -> bool:
        """Drop a request and free its KV; False if it was unknown or already finished."""
        self.scheduler.remove(req_id)
        return self.requests.pop(req_id, None) is not None

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        """Run one prefill or decode batch (an iteration of the mixed policy runs as its prefill
        batch, then its decode batch); return one output per scheduled request."""
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        reqs = [self.requests[s.req_id] for s in batch.seqs]
        self.histograms.observe(ITERATION_TOKENS, batch.num_tokens)
        num_steps = self._greedy_steps(batch, reqs)
        if num_steps > 1:
            outputs = self._run_greedy_steps(batch, reqs, num_steps)
        else:
            inputs = self.runner.prepare(batch, {r.req_id: r.token_ids for r in reqs})
            rows = forward_and_sample(self.runner, self.sampler, inputs, reqs, batch.phase)
            outputs = [self._append(req, row) for req, row in zip(reqs, rows, strict=True)]
        finished = {o.req_id for o in outputs if o.finished}
        self.scheduler.update(batch, finished, num_steps)
        for req_id in finished:
            del self.requests[req_id]
        return outputs

    def _greedy_steps(self, batch: Batch, reqs: list[Request]) -> int:
        """How many decode iterations this batch runs in one call (`num_scheduler_steps`): more
        than one only for a decode batch whose every row is greedy and needs nothing but the
        argmax of its logits (`takes_raw_argmax`), on a runner that takes it, and no more than
        any row may still generate; the scheduler commits them (`extend_decode`)."""
        wanted = self.config.scheduler.num_scheduler_steps
        if wanted <= 1 or batch.phase is not Phase.DECODE:
            return 1
        for req in reqs:
            if not takes_raw_argmax(req.params, req.grammar):
                return 1
            wanted = min(wanted, req.tokens_left)
        if wanted <= 1 or not self.runner.takes_greedy_steps(len(reqs)):
            return 1
        return self.scheduler.extend_decode(batch, wanted)

    def _run_greedy_steps(
        self, batch: Batch, reqs: list[Request], num_steps: int
    ) -> list[RequestOutput]:
        """`num_steps` committed iterations in one call: each request's tokens in one output, up
        to the one that finishes it (the steps after that one are dropped with its blocks)."""
        token_ids = {r.req_id: r.token_ids for r in reqs}
        steps = self.runner.greedy_steps(batch, token_ids, num_steps)  # [step][row]
        for _ in steps[1:]:  # the first was observed with the batch
            self.histograms.observe(ITERATION_TOKENS, batch.num_tokens)
        outputs = []
        for row, req in enumerate(reqs):
            out = self._append(req, SampledRow(steps[0][row]))
            for tokens in steps[1:]:
                if out.finished:
                    break
                out = out.then(self._append(req, SampledRow(tokens[row])))
            outputs.append(out)
        return outputs

    def load_report(self, engine_id: str) -> LoadReport:
        """Its load and counters as a mesh engine reports them (the router's `/metrics`). Safe
        from another thread than the one stepping it: counts and lengths, each read at once."""
        blocks = self.blocks
        running = len(self.scheduler.policy.running)
        return LoadReport(
            engine_id=engine_id, role=Role.MIXED,
            pending_prompt_tokens=max(self.scheduler.pending_prompt_tokens(), 0),
            running_decode_tokens=0, num_running=running,
            num_waiting=max(len(self.requests) - running, 0),
            free_kv_blocks=blocks.num_free_blocks, time=time.time(),
            total_kv_blocks=blocks.num_blocks,
            counters=engine_counters(
                queried=blocks.num_queried_tokens, hits=blocks.num_hit_tokens,
                preemptions=self.scheduler.num_preemptions, kv_blocks_used=blocks.num_used_blocks,
                histograms=self.histograms,
            ),
        )  # fmt: skip

    def _append(self, req: Request, sampled: SampledRow) -> RequestOutput:
        """One request's token, or its end if anything about it failed (its batch-mates go on)."""
        try:
            if isinstance(sampled.token, Exception):
                raise sampled.token
            out = req.append(sampled.token, self.tokenizer if req.params.detokenize else None)
        except Exception as exc:  # noqa: BLE001 - this request's fault, not the step's
            log.warning("request failed", req_id=req.req_id, error=repr(exc))
            return RequestOutput(
                req.req_id, [], "", FinishReason.ABORT, len(req.prompt_token_ids),
                len(req.output_token_ids), error=f"request failed: {exc!r}",
            )  # fmt: skip
        out.logprobs = [] if sampled.logprobs is None else [sampled.logprobs]
        out.prompt_logprobs = sampled.prompt_logprobs
        return out

    def generate(
        self, prompts: Iterable[list[int]], params: SamplingParams | None = None
    ) -> list[list[int]]:
        """Run prompts to completion together; return each one's output token ids, in order."""
        results: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompts):
            req_id = f"generate-{id(results)}-{i}"
            self.add_request(req_id, prompt, params)
            results[req_id] = []
        while any(r in self.requests for r in results):
            for out in self.step():
                if out.req_id in results:
                    results[out.req_id].extend(out.new_token_ids)
        return list(results.values())


def forward_and_sample(
    runner: ModelRunner[Inputs],
    sampler: Sampler,
    inputs: Inputs,
    reqs: list[Request],
    phase: Phase,
) -> list[SampledRow]:
    """One forward and its sampling, for every engine: each row's token (or the exception that
    ended it), its logprobs and, after a prefill, the prompt's (for the requests that ask)."""
    prompt_top = [r.prompt_logprobs_wanted for r in reqs] if phase is Phase.PREFILL else []
    keep_hidden = any(k is not None for k in prompt_top)
    logits = runner.run(inputs, keep_hidden=keep_hidden)
    prompt = runner.prompt_logprobs(inputs, prompt_top) if keep_hidden else []
    return sample_rows(sampler, logits, reqs, prompt)


def sample_rows(
    sampler: Sampler,
    logits: torch.Tensor,
    reqs: list[Request],
    prompt_logprobs: list[list[TokenLogprobs] | None] | None = None,
) -> list[SampledRow]:
    """Each request's next token from its row of `logits` [N, vocab] (a row whose sampling
    failed carries the exception instead), with its logprobs and the prompt's, if given."""
    sampled = sampler.sample(
        logits, [r.params for r in reqs], [len(r.output_token_ids) for r in reqs],
        [(r.prompt_token_ids, r.output_token_ids) for r in reqs],
        grammars=[r.grammar for r in reqs],
    )  # fmt: skip
    return sampled.rows(prompt_logprobs or [])


__all__ = ["FinishReason", "LLMEngine", "RequestOutput", "forward_and_sample", "sample_rows"]
