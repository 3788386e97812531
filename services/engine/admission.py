"""When a handed-off request may start decoding on a token engine, and the sharded ones decoding.

A `DecodeHandoff` waits, first come first served, until its KV is in place:

- with a shard group: not at all. Shards cannot preempt, so each shard holds blocks for
  `prompt + max_tokens` from the request's first KV page on, or refuses the request then
  (`KvPages.reserve_tokens`): a request the shards took never fails for want of a block, and one
  they refused fails alone at its first step (retryable: the router re-runs it). The engine
  cannot tell the two apart before that step, and must not wait for room that a refused request
  would never release. It keeps a mirror of the shards' accounting (`shard_blocks`) for the room
  it reports to the router (`free_shard_blocks`), reserving the same whole length; a request the
  mirror cannot fit (the shards surely refused it) is not counted there;
- with a shard group on `kv_transfer: pull` (`await_landing`): until every shard of the group
  said the request's KV landed there (`note_landed`, from their replies), in any order: a step
  never names a request whose KV a shard still lacks, so no step waits at layer 0 for it
  (Lamina §5). A shard that lost it (refused, or its pull failed) says so, and the engine ends
  the request retryably; one that never lands is ended by `stalled` after its bound;
- without: until every layer of its KV has landed in this engine's own cache (its `KvIngress`
  says so) and its whole length (prompt + `max_tokens`) fits: the blocks it still needs, beside
  those the local scheduler's requests may still grow into (`EngineScheduler.blocks_to_grow`),
  are free. It then joins the engine's local scheduler, which never has to preempt it for a
  token engine's own growth (a mixed engine's new prompts still may, recomputing it as the
  single-process engine does). One that cannot fit waits, first come first served, while room
  is coming (a local request will finish), at most `HANDOFF_KV_WAIT_S`; when none is, it or the
  youngest hand-off holding landed KV behind it ends alone, retryably (`unfittable`), so the
  oldest goes first and nothing waits for room that will not come.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from common.block_manager import BlockManager
from common.protocol import DecodeHandoff
from common.scheduling.batching import EngineScheduler, Sequence

LANDED_MEMORY = 4096  # requests whose landing news is kept before their hand-off comes


class DecodeAdmission:
    """The waiting handoffs and the sharded requests."""

    def __init__(self, shard_num_blocks: int, block_size: int, await_landing: bool = False) -> None:
        self.shard_blocks = BlockManager(max(shard_num_blocks, 1), block_size)
        self.await_landing = await_landing
        # req_id -> the shards (kv endpoints) that said its KV landed; news may come before its
        # hand-off, so it is kept for requests not seen yet too, the oldest dropped past a bound.
        self._landed: OrderedDict[str, set[str]] = OrderedDict()
        self._sharded_handoffs: dict[str, DecodeHandoff] = {}  # of `sharded`, by req_id
        self.sharded: list[Sequence] = []  # decoding against the shard group
        self.waiting: list[DecodeHandoff] = []
        # Sharded requests whose KV may still be on its way to the shards (no step has attended
        # for them yet): not to be swapped in, a shard may not hold it all yet (`confirm`).
        self.arriving: set[str] = set()
        self._arrived: dict[str, float] = {}  # waiting hand-offs: when each came
        # Sharded requests out of the steps while their group's lost heads are rebuilt
        # (shard_rebuild.py): their reservations stay, they resume where they were.
        self.parked: dict[str, Sequence] = {}

    def add(self, handoff: DecodeHandoff, now: float = 0.0) -> None:
        self.waiting.append(handoff)
        self._arrived[handoff.req_id] = now

    def stalled(
        self, now: float, bound_s: float, kv_complete: Callable[[str], bool]
    ) -> list[DecodeHandoff]:
        """Local hand-offs whose KV has not all landed within `bound_s` of their arrival (its
        prompt engine died mid-transfer, or it was refused): they would hold the queue forever."""
        return [
            h for h in self.waiting
            if not self._in_place(h, kv_complete)
            and now - self._arrived.get(h.req_id, now) > bound_s
        ]  # fmt: skip

    def starved(
        self,
        now: float,
        bound_s: float,
        local: EngineScheduler,
        kv_complete: Callable[[str], bool],
        whole_len: Callable[[str], int],
    ) -> list[DecodeHandoff]:
        """The head local hand-off, its KV in place, when no room for its whole length came
        within `bound_s` of its arrival: it would hold the queue behind it."""
        head = next((h for h in self.waiting if not h.shards), None)
        if head is None or not self._in_place(head, kv_complete):
            return []
        if now - self._arrived.get(head.req_id, now) <= bound_s:
            return []
        return [] if self._fits(head, local, whole_len) else [head]

    def note_landed(self, shard: str, req_ids: list[str]) -> None:
        """`shard` (its kv endpoint) says these requests' KV landed whole there."""
        for req_id in req_ids:
            self._landed.setdefault(req_id, set()).add(shard)
            self._landed.move_to_end(req_id)
        while len(self._landed) > LANDED_MEMORY:
            self._landed.popitem(last=False)

    def awaiting_landing(self) -> bool:
        """Sharded hand-offs wait for shards' news (an idle engine asks for it)."""
        return self.await_landing and any(h.shards for h in self.waiting)

    def _in_place(self, h: DecodeHandoff, kv_complete: Callable[[str], bool]) -> bool:
        if not h.shards:
            return kv_complete(h.req_id)
        if not self.await_landing:
            return True
        return {s.kv_endpoint for s in h.shards} <= self._landed.get(h.req_id, set())

    def reserved_tokens(self) -> dict[str, int]:
        """Tokens reserved per shard (kv endpoint) by the requests decoding or waiting here, for
        request-partitioned groups (each request on one shard)."""
        tokens: dict[str, int] = {}
        for h in [*self.waiting, *self._sharded_handoffs.values()]:
            for s in h.shards:
                tokens[s.kv_endpoint] = tokens.get(s.kv_endpoint, 0) + _reserve(h)
        return tokens

    def waiting_blocks(self, local_blocks: BlockManager) -> int:
        """The blocks the waiting hand-offs will reserve when they start: on the shard group,
        their whole length; locally, what their whole length needs beyond the KV landed."""
        need = 0
        for h in self.waiting:
            blocks = self.shard_blocks if h.shards else local_blocks
            held = len(blocks.block_table(h.req_id)) if blocks.has(h.req_id) else 0
            need += max(blocks.blocks_needed(_reserve(h)) - held, 0)
        return need

    def free_shard_blocks(self) -> int:
        """The group's blocks not reserved for a request decoding against it."""
        return self.shard_blocks.num_free_blocks

    def admit(
        self,
        local: EngineScheduler,
        kv_complete: Callable[[str], bool],
        whole_len: Callable[[str], int] | None = None,
    ) -> list[str]:
        """Start every handoff at the head of the queue whose KV is in place; returns their ids.
        Local ones (`kv_complete` says when all their KV landed) join `local` as running
        sequences once their whole length fits (`whole_len`: the most tokens a request of the
        engine may hold; None: only their KV so far is counted)."""
        admitted, still = [], []
        for i, h in enumerate(self.waiting):
            if not self._in_place(h, kv_complete) or (
                not h.shards and whole_len is not None and not self._fits(h, local, whole_len)
            ):
                if not h.shards:  # local ones keep their order: FCFS for this engine's blocks
                    still += self.waiting[i:]
                    break
                still.append(h)  # a sharded one waits for its shards alone
                continue
            seq = Sequence(h.req_id, len(h.token_ids))
            if h.shards:
                if self.shard_blocks.can_grow(h.req_id, _reserve(h)):
                    self.shard_blocks.allocate(h.req_id, _reserve(h))
                seq.num_computed = seq.num_tokens - 1
                self.sharded.append(seq)
                self._sharded_handoffs[h.req_id] = h
                self._landed.pop(h.req_id, None)
                self.arriving.add(h.req_id)
            else:
                local.add_running(seq)
            self._arrived.pop(h.req_id, None)
            admitted.append(h.req_id)
        self.waiting = still
        return admitted

    def unfittable(
        self,
        local: EngineScheduler,
        kv_complete: Callable[[str], bool],
        whole_len: Callable[[str], int],
        room_coming: bool,
    ) -> list[DecodeHandoff]:
        """The local hand-off to refuse so the queue moves: none while the head fits or
        `room_coming` (a local request will finish and free blocks); else the youngest waiting
        hand-off holding landed KV behind the head (its blocks may be what the head lacks), or the
        head itself. A head longer than the whole cache is refused at once."""
        head = next((h for h in self.waiting if not h.shards), None)
        if head is None or not self._in_place(head, kv_complete):
            return []
        if self._fits(head, local, whole_len):
            return []
        if local.blocks.blocks_needed(whole_len(head.req_id)) > local.blocks.num_blocks:
            return [head]
        if room_coming:
            return []
        behind = [h for h in self.waiting if not h.shards and h is not head
                  and local.blocks.has(h.req_id)]  # fmt: skip
        return [behind[-1] if behind else head]

    def _fits(
        self, h: DecodeHandoff, local: EngineScheduler, whole_len: Callable[[str], int]
    ) -> bool:
        """Whether local hand-off `h` may grow to its whole length beside the local requests'
        growth: the blocks both still need are free now."""
        blocks = local.blocks
        held = len(blocks.block_table(h.req_id)) if blocks.has(h.req_id) else 0
        need = max(blocks.blocks_needed(whole_len(h.req_id)) - held, 0)
        return need + local.blocks_to_grow(whole_len) <= blocks.num_free_blocks

    def add_sharded(self, seq: Sequence, reserve_tokens: int) -> None:
        """A request swapped out to the shard group (its KV landed whole there, the shards
        holding `reserve_tokens`): it decodes against the group from the next step."""
        if self.shard_blocks.can_grow(seq.req_id, reserve_tokens):
            self.shard_blocks.allocate(seq.req_id, reserve_tokens)
        seq.num_computed = seq.num_tokens - 1
        self.sharded.append(seq)

    def confirm(self, req_ids: list[str]) -> None:
        """A step attended for these sharded requests on every shard: their KV is there."""
        self.arriving.difference_update(req_ids)

    def park(self) -> list[str]:
        """Every sharded request leaves the steps (a shard of the group died); their ids."""
        self.parked.update((s.req_id, s) for s in self.sharded)
        parked, self.sharded = [s.req_id for s in self.sharded], []
        return parked

    def resume(self, req_id: str) -> bool:
        """A parked request decodes again from the next step (its lost heads were rebuilt)."""
        seq = self.parked.pop(req_id, None)
        if seq is None:
            return False
        self.sharded.append(seq)
        self.arriving.add(req_id)  # the rebuilt KV may still be on its way
        return True

    def grow_sharded(self) -> None:
        """Account this step's new token of every sharded request (within its reservation)."""
        for seq in self.sharded:
            if self.shard_blocks.has(seq.req_id):  # not counted: see the module docstring
                self.shard_blocks.grow(seq.req_id, seq.num_tokens)

    def is_decoding_here(self, req_id: str) -> bool:
        """Sharded here or waiting to be: this engine then owns freeing the request's shards."""
        return (
            req_id in self.parked
            or any(s.req_id == req_id for s in self.sharded)
            or any(h.req_id == req_id for h in self.waiting)
        )

    def remove(self, req_id: str) -> None:
        """Forget a request wherever it is here (finished or aborted): its shard reservation goes
        back."""
        self.sharded = [s for s in self.sharded if s.req_id != req_id]
        self.parked.pop(req_id, None)
        self._sharded_handoffs.pop(req_id, None)
        self.arriving.discard(req_id)
        self.shard_blocks.free(req_id)
        self.waiting = [h for h in self.waiting if h.req_id != req_id]
        self._arrived.pop(req_id, None)
        self._landed.pop(req_id, None)

    def waiting_for(self, req_id: str) -> DecodeHandoff | None:
        return next((h for h in self.waiting if h.req_id == req_id), None)


def _reserve(handoff: DecodeHandoff) -> int:
    """The tokens a request may hold: its prompt and every token it may generate (its whole
    length, as its shards and the router's KV admission count it)."""
    return handoff.num_prompt_tokens + handoff.sampling.max_tokens


__all__ = ["DecodeAdmission"]
