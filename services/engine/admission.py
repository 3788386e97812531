"""When a handed-off request may start decoding on a token engine, and the sharded ones decoding.

A `DecodeHandoff` waits, first come first served, until its KV is in place:

- with a shard group: not at all (its KV is on the shards already). The shards hold a request's
  tokens so far: its prompt's from its first KV page, then one more per decode step. The engine
  counts the same (`shard_blocks`, `ShardGroupBlocks`) and reports the room left to the router,
  which admits by a request's tokens plus a bounded headroom, not its whole length. The KV grows
  on demand, so before each step `fit_growth` makes room for every sharded request's next token
  by Splitwise's memory-aware batching, the mixed policy's rules (`next_victim`,
  common/scheduling/mixed.py): the youngest decode is preempted first, one preempted
  `max_preemptions` times only as a last resort. A preempted request's shard KV is freed; it
  waits, oldest first, until the group has room for its tokens and every running request's next
  one (`resumable`; one that has waited `starvation_s` preempts younger ones under the cap, the
  policy's aging), and is then recomputed: the engine prefills its prompt and tokens so far
  itself, ships that KV to the shards as a new `kv_generation` (a preemption's free and the new
  KV may land in either order) and decodes on (`resumed`). Its client sees a longer gap between
  two tokens, never an error; greedy output is unchanged; the router sees no migration. A shard
  that still cannot grow or hold a request's KV (the engine's count and its own disagree: a
  prompt's KV landed before its hand-off came, a free is still in flight) fails that row
  alone, and the request is recomputed the same way (`recomputes`), each time after a longer
  wait (`RECOMPUTE_BACKOFF_S`), or, after `MAX_RECOMPUTES` such failures, ends retryably. The
  shards keep a block free per request decoding there when new KV lands, so the room counted
  here for the next step is there (`_room_for` leaves it too). While preempted, a request
  sends its router an empty output now and then (`quiet`; the engine does the same for any
  request it holds that streamed nothing for a while, `Engine._still_alive`): its progress
  deadline would otherwise re-run it elsewhere.
  Faults: a shard that dies ends every request tied to the group, preempted ones included
  (faults.py `relink`), and the router re-runs them; a token engine that dies takes its
  preempted requests' state with it, and the router re-runs them like its others, from the
  tokens it streamed; wrong counts cost a recompute, not a request;
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
from collections.abc import Callable, Collection
from itertools import count

from common.block_manager import BlockManager
from common.protocol import DecodeHandoff
from common.scheduling.batching import EngineScheduler, Sequence
from common.scheduling.mixed import SeqState, next_victim, preemption_order

LANDED_MEMORY = 4096  # requests whose landing news is kept before their hand-off comes
# A sharded request its shards failed this often (refused or could not grow its KV) ends,
# retryably, instead of being recomputed here once more: its shards disagree with this count.
# After its n-th such failure it waits at least RECOMPUTE_BACKOFF_S * 2**(n-1) to be recomputed.
MAX_RECOMPUTES = 8
RECOMPUTE_BACKOFF_S = 0.05


class ShardGroupBlocks:
    """The token engine's count of its shard group's KV blocks (head-split: each shard's, which
    all hold every request; request-partitioned: their sum): per request decoding against the
    group, the blocks its tokens so far take. A count, not a `BlockManager`: a hand-off whose KV
    already landed is counted even past capacity, and growth then preempts (`fit_growth`)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self._held: dict[str, int] = {}

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def has(self, req_id: str) -> bool:
        return req_id in self._held

    def held(self, req_id: str) -> int:
        return self._held.get(req_id, 0)

    def hold(self, req_id: str, num_tokens: int) -> None:
        """`req_id` holds (at least) `num_tokens` tokens of KV on the group now."""
        self._held[req_id] = max(self.held(req_id), self.blocks_needed(num_tokens))

    def free(self, req_id: str) -> None:
        self._held.pop(req_id, None)

    @property
    def num_used_blocks(self) -> int:
        return sum(self._held.values())

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, never below 0 (`overdrawn` says by how much the count is past them)."""
        return max(self.num_blocks - self.num_used_blocks, 0)

    @property
    def overdrawn(self) -> int:
        return max(self.num_used_blocks - self.num_blocks, 0)


class DecodeAdmission:
    """The waiting handoffs, the sharded requests, and the sharded requests preempted."""

    def __init__(
        self,
        shard_num_blocks: int,
        block_size: int,
        await_landing: bool = False,
        max_preemptions: int = 2,
        starvation_s: float = 1.0,
    ) -> None:
        self.shard_blocks = ShardGroupBlocks(max(shard_num_blocks, 1), block_size)
        self.await_landing = await_landing
        self.max_preemptions, self.starvation_s = max_preemptions, starvation_s  # mixed policy's
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
        # The mixed policy's view of each sharded request (arrival order, preemptions), for its
        # victim choice; and the preempted ones waiting to be recomputed, oldest first.
        self._ages: dict[str, SeqState] = {}
        self._order = count()
        self.preempted: list[tuple[SeqState, Sequence]] = []
        self.resuming: set[str] = set()  # given back to be recomputed (`resumable`)
        self._told: dict[str, float] = {}  # preempted or resuming: when its router last heard
        self._failures: dict[str, int] = {}  # sharded requests' rows its shards failed
        self.num_preemptions = 0  # in all, for metrics and tests

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
                tokens[s.kv_endpoint] = tokens.get(s.kv_endpoint, 0) + _whole_len(h)
        return tokens

    def waiting_blocks(self, local_blocks: BlockManager) -> int:
        """The blocks the waiting hand-offs and the preempted requests will take when they
        start: on the shard group, their tokens so far and the next one's; locally, what their
        whole length needs beyond the KV landed."""
        need = sum(self.shard_blocks.blocks_needed(s.num_tokens + 1) for _, s in self.preempted)
        for h in self.waiting:
            if h.shards:
                need += self.shard_blocks.blocks_needed(len(h.token_ids) + 1)
                continue
            held = len(local_blocks.block_table(h.req_id)) if local_blocks.has(h.req_id) else 0
            need += max(local_blocks.blocks_needed(_whole_len(h)) - held, 0)
        return need

    def free_shard_blocks(self) -> int:
        """The group's blocks no request decoding against it holds."""
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
                # Counted even past capacity (its KV is on the shards): the next step's
                # `fit_growth` preempts, the youngest first, so the count is true again.
                self.shard_blocks.hold(h.req_id, seq.num_tokens)
                arrival = self._arrived.get(h.req_id, 0.0)
                self._ages[h.req_id] = SeqState(h.req_id, h.num_prompt_tokens, arrival,
                                                next(self._order))  # fmt: skip
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

    def add_sharded(self, seq: Sequence, reserve_tokens: int, now: float = 0.0) -> None:
        """A request swapped out to the shard group (its KV landed whole there, the shards
        holding `reserve_tokens`): it decodes against the group from the next step."""
        self.shard_blocks.hold(seq.req_id, max(reserve_tokens, seq.num_tokens))
        self._ages.setdefault(seq.req_id, SeqState(seq.req_id, seq.num_tokens, now,
                                                   next(self._order)))  # fmt: skip
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

    # -- growth and preemption (Splitwise's memory-aware batching; see the module docstring) --

    def fit_growth(self, now: float) -> list[str]:
        """Make room on the group for this step's token of every sharded request: while their
        growth would overflow it, preempt the mixed policy's victim (`next_victim`: the
        youngest, the `max_preemptions` cap kept unless nothing else is left); then count the
        growth. Returns the preempted ids: the caller frees their KV on the shards."""
        preempted: list[str] = []
        blocks = self.shard_blocks
        while self.sharded and blocks.num_used_blocks + self._growth() > blocks.num_blocks:
            victim = next_victim([self._ages[s.req_id] for s in self.sharded],
                                 self.max_preemptions)  # fmt: skip
            if victim is None:
                break
            self.preempt(str(victim.req_id), now)
            preempted.append(str(victim.req_id))
        for seq in self.sharded:
            blocks.hold(seq.req_id, seq.num_tokens)
        return preempted

    def _growth(self, extra: int = 0) -> int:
        """Blocks the sharded requests' next token takes (`extra` more tokens each)."""
        blocks = self.shard_blocks
        return sum(max(blocks.blocks_needed(s.num_tokens + extra) - blocks.held(s.req_id), 0)
                   for s in self.sharded)  # fmt: skip

    def preempt(self, req_id: str, now: float) -> None:
        """Take a sharded request off the group (its KV there is to be freed): it waits, oldest
        first, to be recomputed from its tokens (`resumable`)."""
        seq = next(s for s in self.sharded if s.req_id == req_id)
        self.sharded.remove(seq)
        self.arriving.discard(req_id)
        self.shard_blocks.free(req_id)
        age = self._ages.pop(req_id)
        age.num_preemptions += 1
        age.waiting_since_s = now
        seq.num_preemptions += 1
        seq.num_computed = 0
        self.preempted.append((age, seq))
        self.preempted.sort(key=lambda p: (p[0].arrival_s, p[0].order))
        self.num_preemptions += 1
        self._told.setdefault(req_id, now)

    def resumable(self, now: float) -> tuple[list[Sequence], list[str]]:
        """The preempted requests to recompute now, oldest first while the group has room for
        their tokens and every sharded request's next one; a head that has waited
        `starvation_s` (the mixed policy's aging) preempts younger requests under the cap to
        make that room. Returns (those to recompute, those preempted for them). Their room is
        counted from now; `resumed` says when their KV was shipped again."""
        resumed: list[Sequence] = []
        preempted: list[str] = []
        while self.preempted:
            age, seq = self.preempted[0]
            failures = self._failures.get(seq.req_id, 0)
            if failures and now - age.waiting_since_s < RECOMPUTE_BACKOFF_S * 2 ** (failures - 1):
                break  # its shards failed it: not at once again
            need = self.shard_blocks.blocks_needed(seq.num_tokens + 1)
            if not self._room_for(need) and not (
                now - age.waiting_since_s >= self.starvation_s
                and self._preempt_younger(age, need, now, preempted)
            ):
                break
            self.preempted.pop(0)
            self.shard_blocks.hold(seq.req_id, seq.num_tokens)
            self._ages[seq.req_id] = age
            self.resuming.add(seq.req_id)
            resumed.append(seq)
        return resumed, preempted

    def _room_for(self, blocks: int) -> bool:
        """Whether `blocks` more fit beside the sharded requests' next tokens, and a block for
        each of them that the shards keep free when new KV lands (services/shard/shard.py)."""
        used = self.shard_blocks.num_used_blocks + self._growth() + blocks + len(self.sharded)
        return used <= self.shard_blocks.num_blocks

    def _preempt_younger(self, age: SeqState, need: int, now: float, out: list[str]) -> bool:
        """Preempt sharded requests younger than `age` (in the policy's order, under the cap)
        until `need` blocks fit; none at all (False) when even all of them would not free
        enough."""
        younger = [a for a in preemption_order([self._ages[s.req_id] for s in self.sharded],
                                               self.max_preemptions)
                   if (a.arrival_s, a.order) > (age.arrival_s, age.order)]  # fmt: skip
        freeable = sum(self.shard_blocks.held(str(a.req_id)) for a in younger)
        if self.shard_blocks.num_used_blocks - freeable + need > self.shard_blocks.num_blocks:
            return False
        for victim in younger:
            if self._room_for(need):
                break
            self.preempt(str(victim.req_id), now)
            out.append(str(victim.req_id))
        return self._room_for(need)

    def kv_generation(self, req_id: str) -> int:
        """The generation of a sharded request's KV on the group: how often it was preempted
        (`KvPages.kv_generation`)."""
        age = self._ages.get(req_id) or next((a for a, s in self.preempted if s.req_id == req_id),
                                             None)  # fmt: skip
        return 0 if age is None else age.num_preemptions

    def recomputes(self, req_id: str, failed: Collection[str]) -> bool:
        """Whether a sharded request a shard failed (`failed`: could not grow or hold its KV)
        is preempted and recomputed here; False, ending it, when it is not failed, when shards
        report landing (`await_landing`: their news ends it), or past `MAX_RECOMPUTES`."""
        if req_id not in failed or (self.await_landing and req_id in self.arriving):
            return False
        failures = self._failures.get(req_id, 0) + 1
        self._failures[req_id] = failures
        return failures <= MAX_RECOMPUTES

    def quiet(self, now: float, every_s: float) -> list[str]:
        """Preempted requests (waiting, or being recomputed) that have streamed nothing for
        `every_s`: their router must hear that they live (an empty output), or its progress
        deadline would re-run them elsewhere."""
        due = [r for r, at in self._told.items() if now - at >= every_s]
        for req_id in due:
            self._told[req_id] = now
        return due

    def resumed(self, req_id: str, num_tokens: int) -> None:
        """A recomputed request's KV (`num_tokens - 1` tokens) is shipped to the group again and
        its next token sampled: it decodes against the group from the next step."""
        if req_id not in self.resuming:
            return  # it ended meanwhile
        self.resuming.discard(req_id)
        self._told.pop(req_id, None)
        seq = Sequence(req_id, num_tokens)
        seq.num_computed = num_tokens - 1
        self.sharded.append(seq)
        self.arriving.add(req_id)

    def is_decoding_here(self, req_id: str) -> bool:
        """Sharded here or waiting to be (parked and preempted included): this engine then owns
        freeing the request's shards."""
        return (
            req_id in self.parked
            or any(s.req_id == req_id for s in self.sharded)
            or any(h.req_id == req_id for h in self.waiting)
            or any(s.req_id == req_id for _, s in self.preempted)
            or req_id in self.resuming
        )

    def remove(self, req_id: str) -> None:
        """Forget a request wherever it is here (finished or aborted): its shard reservation goes
        back."""
        self.sharded = [s for s in self.sharded if s.req_id != req_id]
        self.parked.pop(req_id, None)
        self._sharded_handoffs.pop(req_id, None)
        self.arriving.discard(req_id)
        self.shard_blocks.free(req_id)
        self.preempted = [(a, s) for a, s in self.preempted if s.req_id != req_id]
        self.resuming.discard(req_id)
        self._told.pop(req_id, None)
        self._failures.pop(req_id, None)
        self._ages.pop(req_id, None)
        self.waiting = [h for h in self.waiting if h.req_id != req_id]
        self._arrived.pop(req_id, None)
        self._landed.pop(req_id, None)

    def waiting_for(self, req_id: str) -> DecodeHandoff | None:
        return next((h for h in self.waiting if h.req_id == req_id), None)


def _whole_len(handoff: DecodeHandoff) -> int:
    """The tokens a request may hold: its prompt and every token it may generate (its whole
    length, as the router's check that it could ever fit counts it)."""
    return handoff.num_prompt_tokens + handoff.sampling.max_tokens


__all__ = ["DecodeAdmission"]
