"""Long prefills a chunk at a time (Sarathi-Serve's chunked prefills, vLLM's chunked prefill), so
that no step of an engine lasts longer than one chunk of `MeshOptions.prefill_chunk_tokens`.

Why: an engine runs one phase per forward, and its prefill queue (prompts to ship, recomputes of
preempted requests, rebuilds of a lost shard's heads) goes before its decode steps. A recompute of
a long stream (its prompt and every token so far, thousands) in one forward stalled every other
stream on the engine for as long, and past the router's progress deadline the streams were
re-run elsewhere for nothing. In chunks, each step is bounded, the engine's loop turns between
them (aborts, hand-offs, its "alive" outputs), and the engine runs a decode step whenever one
chunk's worth of prefill tokens has run since the last (`PrefillChunks.decode_owed`): a decode
waits for at most about one chunk, whatever queues ahead of it.

How: the batch's KV blocks are reserved whole when its scheduler hands it out. Each chunk step
computes the next span of one sequence's tokens into them, attending over its earlier tokens
through the prefix-cache path (common/attention/prefix_prefill.py), and samples nothing. The last
step is the batch itself, each sequence's `num_computed` where its chunks left it: it samples and
ships exactly as an unchunked batch does (the whole KV, the chunks' part read back from the
cache). A batch of at most one chunk runs as before, in one step. A mixed engine's own prompts
(its local scheduler's prefill) are not chunked.

Faults: a request aborted between chunks has left its scheduler (which freed its blocks): it
leaves the batch at the next step, the others go on. The engine's process dying loses the batch
with the engine, as an unchunked one (its routers re-run the requests).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.scheduling.batching import Batch, EngineScheduler, Phase, Sequence


@dataclass
class PrefillStep:
    """What to run next: a chunk (compute only) or the batch's last step (sample and ship)."""

    batch: Batch
    is_chunk: bool


class PrefillChunks:
    """The prefill batch being computed in chunks, and the prefill tokens since the last decode."""

    def __init__(self, chunk_tokens: int) -> None:
        if chunk_tokens <= 0:
            raise ValueError("prefill_chunk_tokens must be positive")
        self.chunk_tokens = chunk_tokens
        self.batch: Batch | None = None  # a batch longer than a chunk, being computed
        self.since_decode = 0  # prefill tokens run since the engine's last decode step
        self.num_chunks = 0  # chunk steps run, since start (stats, tests)

    @property
    def decode_owed(self) -> bool:
        """A chunk's worth of prefill ran since the last decode step: decode next."""
        return self.since_decode >= self.chunk_tokens

    def decoded(self) -> None:
        self.since_decode = 0

    def next_step(self, scheduler: EngineScheduler) -> PrefillStep | None:
        """The next prefill step of `scheduler`'s queue: the next chunk of the batch in progress,
        or its last step, or a new batch (its first chunk when it is longer than one); None when
        there is nothing to prefill now."""
        if self.batch is None:
            batch = scheduler.schedule()
            if batch is None:
                return None
            if batch.phase is not Phase.PREFILL or batch.num_tokens <= self.chunk_tokens:
                return self._ran(PrefillStep(batch, is_chunk=False))
            self.batch = batch
        # Requests aborted since the last step left the scheduler (their blocks freed).
        self.batch.seqs = [s for s in self.batch.seqs if scheduler.seqs.get(s.req_id) is s]
        if not self.batch.seqs:
            self.batch = None
            return self.next_step(scheduler)
        if self.batch.num_tokens > self.chunk_tokens:
            return self._ran(PrefillStep(self._chunk(self.batch), is_chunk=True))
        last, self.batch = self.batch, None
        return self._ran(PrefillStep(last, is_chunk=False))

    def _chunk(self, batch: Batch) -> Batch:
        """The next span of the first sequence with more than its last token left (the last
        token is the batch's last step's, whose logits it samples); its `num_computed` moves on."""
        seq = next(s for s in batch.seqs if s.num_tokens - s.num_computed > 1)
        end = min(seq.num_computed + self.chunk_tokens, seq.num_tokens - 1)
        span = Sequence(seq.req_id, end, num_computed=seq.num_computed)
        seq.num_computed = end
        self.num_chunks += 1
        return Batch(Phase.PREFILL, [span])

    def _ran(self, step: PrefillStep) -> PrefillStep:
        self.since_decode += step.batch.num_tokens
        return step


__all__ = ["PrefillChunks", "PrefillStep"]
