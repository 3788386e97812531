"""How many replicas a mesh role needs: a pure decision over load samples (issue 50).

Serve's own autoscaler counts requests that pass through Serve; engines and shards get their work
over ZeroMQ, so each replica reports the load that matters for its role instead
(`services/mesh/autoscaling.py`) and this policy turns those reports into a replica count. It is
pure, so a simulator can replay it on a recorded load series (tests/unit/test_autoscale_policy.py).

What the peers' users complain about, and the rule here that prevents it:

- **Flapping** (2 <-> 1 every few minutes): a dead band (`scale_down_fill`): scaling down needs
  the load to fit the smaller size with room to spare, not merely to dip under the target; a
  wanted change must persist (`upscale_after_s`, in groups x seconds, see below, /
  `downscale_after_s`), and after any change none happens for `cooldown_s`.
- **Cold-start samples inflating the count**: a replica younger than `warmup_s` is still loading
  weights or compiling; its samples are left out (its queue is not yet the mesh's queue).
- **A step taken in several decisions** (1 -> 3 -> 5 -> 6 while the new replicas start): a
  replica's arrival rate (`prompt_tokens_per_s` against what one replica serves at its SLO)
  says at once how many the step needs, where a queue only grows towards it; the count goes
  there in one decision (up to `max_step` groups). While replicas it added are still warming up,
  no further scale-up: the backlog the old ones queued while the new ones started is what those
  were added to take, and it is gone by the time they report. (So `cooldown_s` should cover a
  replica's start-up: the next decision then finds the new replicas reporting, young.)
- **Scale-downs that cannot hold the load** (consolidation-aware): the load must fit N-1 replicas
  at `scale_down_fill` of their target, so removing one never pushes the rest past the target.
- **A step met at the edge**: a scale-up goes to where the load sits in the middle of the dead
  band (halfway between `scale_down_fill` and the target), so the next swing of the load neither
  adds nor removes a replica.
- **Replicas bought for a swing kept for good**: a scale-up for a swing of the load (past the
  target by less than the dead band) may size its peak at the target instead (`swing_fill`):
  sized to the band's middle, the band's floor sits so far under the load's usual level that
  a load that keeps swinging never lets the extra replicas go (`ScalePolicy.swing_share`).
- **A swing's replicas kept by a load that keeps swinging** (its peaks cross one group less's
  floor every few minutes, so no `downscale_after_s` passes with every reading under it): with
  `scale_down_peak_fill`, the last `downscale_after_s` of readings may scale down instead when
  their mean fits the smaller size at `scale_down_fill` and their peak at that share of the
  target, back to at most the count the last scale-up began from (`window_allows`).
- **Step explosions**: at most `max_step` groups per decision.
- **A step that arrives before its replicas** (a load step, then a minute of start-up with the
  old size taking it all): a scale-up's hold (`upscale_after_s`) fills with the groups the load
  needs now beyond the current size, per second: one group more waits the whole hold, k more
  about 1/k of it, so a step's replicas start seconds after it while a swing of a group waits.
  And with `lead_s`, a step is sized for its load `lead_s` ahead, its rise over the last
  `trend_s` (`ScaleState.slope`) projected that far (`Load.ahead`): the look-back average Serve
  hands the policy lags a rising load (by half its window on a ramp), so the first readings of
  a step, still mostly the load before it, would otherwise size it short and a second scale-up
  would mend it. Only a step is projected (a load past the current size's target by more than
  the dead band is wide: a flat load's swings stay within it, and a slope of its noise would
  inflate the scale-ups it begins); only a rise, only while the same replicas report (one
  entering or leaving the sum moves it with no change of load); scale-downs go by the load
  there is. State lost (a controller restart, a count changed by hand) restarts the trend: no
  projection until a span has passed.
- **Half a shard group**: shards come and go in whole groups of `group_size` (a token engine
  claims `shards_per_group` of them), so counts are multiples of it.

An SLO breach (a latency p90 over its bound) asks for one more group even when the load figure
says the size is enough: queueing is not the only way to miss an SLO (long contexts, a slow node).
Pure: the caller passes `now` and keeps the `ScaleState` between calls.

Token engines and their shards are one unit (`decide_groups`): a group is a token engine and the
`shards_per_group` shards it claims, its load the larger of its engines' (running decode tokens,
KV fill) and its shards' (KV fill), so +1 token engine comes with +`shards_per_group` shards and
-1 with -`shards_per_group`: no token engine without its shards, no shard without a claimant.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import NamedTuple


@dataclass(frozen=True)
class ScalePolicy:
    """Targets, bounds and delays of one role (the YAML's `policy_kwargs`)."""

    target_load: float  # the load one replica carries at its SLO (role's unit: tokens, blocks)
    min_replicas: int = 1
    max_replicas: int = 8
    group_size: int = 1  # replicas that come and go together (a shard group)
    max_step: int = 1  # groups added or removed per decision
    upscale_after_s: float = 10.0  # how long more replicas must be wanted before they come
    downscale_after_s: float = 60.0  # how long fewer must be wanted before one goes
    cooldown_s: float = 30.0  # no change this soon after the last one
    warmup_s: float = 30.0  # samples of a replica younger than this are ignored
    scale_down_fill: float = 0.7  # scale down only if the load fits N-1 at this share of target
    lead_s: float = 0.0  # size a step for its load this far ahead (0: for the load now)
    trend_s: float = 10.0  # the span a load's rise is measured over (>= the report interval)
    # A scale-up for a swing (not a step) sizes its peak to this share of the target, in
    # [scale_down_fill, 1] (None: the dead band's middle, as a step); see `swing_share`.
    swing_fill: float | None = None
    # A scale-down over a swinging load (`window_allows`): when the last `downscale_after_s` of
    # readings' mean fits one group less at `scale_down_fill` and their peak at this share of
    # the target, in [scale_down_fill, 1] (None: every reading must fit at `scale_down_fill`).
    scale_down_peak_fill: float | None = None

    def __post_init__(self) -> None:
        if self.target_load <= 0:
            raise ValueError("target_load must be positive")
        if self.group_size < 1 or self.max_step < 1:
            raise ValueError("group_size and max_step must be at least 1")
        if not 0 < self.scale_down_fill <= 1:
            raise ValueError("scale_down_fill must be in (0, 1]")
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError("need 0 <= min_replicas <= max_replicas")
        if self.min_replicas % self.group_size or self.max_replicas % self.group_size:
            raise ValueError("min_replicas and max_replicas must be multiples of group_size")
        if self.trend_s <= 0:
            raise ValueError("trend_s must be positive")
        for name in ("upscale_after_s", "downscale_after_s", "cooldown_s", "warmup_s", "lead_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")
        if self.swing_fill is not None and not self.scale_down_fill <= self.swing_fill <= 1:
            raise ValueError("swing_fill must be in [scale_down_fill, 1]")
        peak_fill = self.scale_down_peak_fill
        if peak_fill is not None and not self.scale_down_fill <= peak_fill <= 1:
            raise ValueError("scale_down_peak_fill must be in [scale_down_fill, 1]")

    @property
    def middle_fill(self) -> float:
        """The middle of the dead band, as a share of the target: where a step's scale-up
        puts its load."""
        return (1 + self.scale_down_fill) / 2

    @property
    def swing_share(self) -> float:
        """Where a scale-up for a swing of the load (past the current size's target by less
        than the dead band, `is_step`) puts the swing's peak, as a share of the target.

        1 sizes the swing at the target: the fewest replicas that carry its peak. Sized to the
        band's middle instead, the peak buys replicas for a rise that is not coming, and the
        band's floor (one group less at `scale_down_fill`) then sits under the load's usual
        level: the extra replicas stay for as long as the load keeps swinging back into the
        band (a wish to scale down ends at its first reading there). A larger swing later adds
        a group more, for load that is there. That suits a role whose load leads a step (a
        prompt engine's arrival rate): its scale-up is in time. The middle (None, the default)
        keeps headroom for a role whose load lags a step (a token engine's decode tokens build
        up for a decode's length after the prompts arrive, so its scale-up comes late and the
        replicas there meet the step's first half minute)."""
        return self.middle_fill if self.swing_fill is None else self.swing_fill


@dataclass(frozen=True)
class LoadSample:
    """One replica's latest report."""

    replica_id: str
    load: float  # in the policy's unit (see `ScalePolicy.target_load`)
    age_s: float  # since the replica started
    slo_breached: bool = False  # its latency p90 is over its SLO
    lent: bool = False  # load of this role carried by another role's replica (not one of its own)


# The most slots the scale-down window keeps (`ScaleState.windowed`), however often it is read.
WINDOW_SLOTS = 64


class WindowSlot(NamedTuple):
    """The readings of one slot of the scale-down window (`ScaleState.windowed`): a span of
    `downscale_after_s / (WINDOW_SLOTS - 1)` seconds on a grid from time 0."""

    slot: float  # its index on the grid (the reading's time where the window is 0 s long)
    last_at: float  # the time of its latest reading
    total: float  # the sum of its readings' totals
    readings: int  # how many
    peak: float  # the largest of its readings' totals

    def read(self, at: float, total: float) -> WindowSlot:
        """This slot with one more reading, at `at`."""
        peak = max(self.peak, total)
        return WindowSlot(self.slot, at, self.total + total, self.readings + 1, peak)


@dataclass(frozen=True)
class ScaleState:
    """What the policy remembers between decisions."""

    replicas: int  # the count it decided last
    wanted: int = 0  # the count it has been wanting (0: none different from `replicas`)
    wanted_since: float | None = None
    seen_at: float | None = None  # the wish's latest reading
    surplus: float = 0.0  # groups x seconds a scale-up has been wanted for (`advance`)
    last_change_at: float | None = None
    num_changes: int = 0
    # The load's trend (`ScaleState.trended`): the reading its current span began with (when,
    # the total, how many replicas reported it) and the rise per second over the last full span.
    trend_at: float | None = None
    trend_load: float = 0.0
    trend_count: int = 0
    slope: float = 0.0
    # The scale-down window (`ScaleState.windowed`): its readings of the last
    # `downscale_after_s` in slots, oldest first, and when it began (its readings unbroken since).
    window: tuple[WindowSlot, ...] = ()
    window_since: float | None = None
    risen_from: int | None = None  # the count the last change, a scale-up, began from

    def changed_to(self, replicas: int, now: float) -> ScaleState:
        """This state after a change to `replicas` at `now`: no wish pending, the cool-down's
        clock restarted, and the scale-down window begun anew (a scale-up remembers the count
        it began from: `risen_from`)."""
        risen_from = self.replicas if replicas > self.replicas else None
        return replace(self, replicas=replicas, wanted=0, wanted_since=None, seen_at=None,
                       surplus=0.0, last_change_at=now, num_changes=self.num_changes + 1,
                       window=(), window_since=None, risen_from=risen_from)  # fmt: skip

    def cooling(self, policy: ScalePolicy, now: float) -> bool:
        """Whether the last change was under `cooldown_s` ago (no change may follow yet)."""
        return self.last_change_at is not None and now - self.last_change_at < policy.cooldown_s

    def windowed(self, policy: ScalePolicy, load: Load, now: float) -> ScaleState:
        """This state with `load` read into the scale-down window (only with
        `scale_down_peak_fill`): a reading with nothing warm, a replica warming up or one
        decided and not reporting begins it anew (no scale-down goes by those), as does a clock
        that went back; readings older than `downscale_after_s` leave it.

        In bounded space, however often it is read (Serve's control loop reads several times a
        second): the readings are summed in slots of `downscale_after_s / (WINDOW_SLOTS - 1)`
        seconds (each its readings' sum, count and peak), at most `WINDOW_SLOTS` of them, and a
        slot leaves once its latest reading is older than `downscale_after_s`. So the window's
        mean and peak (`window_mean_peak`) are the exact ones of its readings whenever no slot
        holds readings from both sides of that horizon: always where readings come at most once
        a slot (every 5 s for a 300 s window, as in the tests' recorded loads). Otherwise the
        oldest slot may keep readings up to one slot's width older than the horizon: the window
        then spans between `downscale_after_s` and a slot (1/63 of it) more."""
        if policy.scale_down_peak_fill is None:
            return self
        if (
            load.total is None
            or load.warming
            or load.starting
            or (self.window and now < self.window[-1].last_at)
        ):
            return replace(self, window=(), window_since=None)
        horizon = now - policy.downscale_after_s
        width = policy.downscale_after_s / (WINDOW_SLOTS - 1)
        slot = math.floor(now / width) if width > 0 else now
        window = self.window
        first = 0
        while first < len(window) and window[first].last_at < horizon:
            first += 1
        if first < len(window) and window[-1].slot == slot:
            kept = (*window[first:-1], window[-1].read(now, load.total))
        else:  # a new slot; and at most WINDOW_SLOTS (the grid's rounding could leave one more)
            new = WindowSlot(slot, now, load.total, 1, load.total)
            kept = (*window[max(first, len(window) + 1 - WINDOW_SLOTS) :], new)
        since = now if self.window_since is None else self.window_since
        return replace(self, window=kept, window_since=since)

    def window_mean_peak(self) -> tuple[float, float]:
        """The mean and the peak of the scale-down window's readings (a window read at least
        once; how exact: `windowed`)."""
        readings = sum(s.readings for s in self.window)
        return sum(s.total for s in self.window) / readings, max(s.peak for s in self.window)

    def trended(self, policy: ScalePolicy, load: Load, now: float) -> ScaleState:
        """This state with `load` read into its trend: once a span of `trend_s` has passed, the
        slope is the total's change over it and a new span begins. No total (nothing warm)
        keeps the trend as it is; a change in how many replicas report (one warmed up, one left,
        a restart of the clock) begins a new span with no slope: the total moved by membership,
        not by load."""
        if load.total is None:
            return self
        fresh = self.trend_at is None or now < self.trend_at or load.reporting != self.trend_count
        if fresh:
            return replace(self, trend_at=now, trend_load=load.total,
                           trend_count=load.reporting, slope=0.0)  # fmt: skip
        assert self.trend_at is not None
        span = now - self.trend_at
        if span < policy.trend_s:
            return self
        slope = (load.total - self.trend_load) / span
        return replace(self, trend_at=now, trend_load=load.total, slope=slope)


@dataclass(frozen=True)
class Load:
    """What the warm samples say: their total (in replicas' worth), whether any replica is still
    warming up, whether any breached its SLO; None total: no warm sample to go on."""

    total: float | None
    warming: bool = False
    slo_breached: bool = False
    starting: bool = False  # fewer of its own replicas report than were decided
    reporting: int = 0  # the warm samples the total sums

    @classmethod
    def of(
        cls, policy: ScalePolicy, samples: Iterable[LoadSample], per: float = 1.0,
        expected: int = 0,
    ) -> Load:  # fmt: skip
        """The load of `samples`, each divided by `per` (a shard's load in groups' worth);
        `expected`: how many of the role's own replicas were decided (0: not known)."""
        samples = list(samples)
        warm = [s for s in samples if s.age_s >= policy.warmup_s]
        # A replica added and not reporting yet (Serve starts it) holds any scale-down: the
        # load it was added for may have moved elsewhere meanwhile (the mixed pool), and a
        # count that drops before it runs flaps. It holds no scale-up: one that never reports
        # (its hook broken) must not freeze the count below the load.
        starting = sum(not s.lent for s in samples) < expected
        # A replica still warming up was added for a reason: no scale-down until it reports for
        # real, and no scale-up on the backlog it was added to take (`wanted_for`).
        if not warm:
            return cls(None, warming=bool(samples), starting=starting)
        total = sum(max(s.load, 0.0) for s in warm) / per
        return cls(total, len(warm) < len(samples), any(s.slo_breached for s in warm), starting,
                   len(warm))  # fmt: skip

    def __or__(self, other: Load) -> Load:
        """Two loads of one unit (a group's engines and its shards): the larger asks."""
        totals = [t for t in (self.total, other.total) if t is not None]
        return Load(max(totals) if totals else None, self.warming or other.warming,
                    self.slo_breached or other.slo_breached,
                    self.starting or other.starting,
                    self.reporting + other.reporting)  # fmt: skip

    def ahead(self, policy: ScalePolicy, state: ScaleState) -> Load:
        """This load `policy.lead_s` ahead: its total plus the trend's rise over that long (a
        fall is not projected: scale-downs go by the load there is)."""
        if self.total is None or policy.lead_s <= 0 or state.slope <= 0:
            return self
        return replace(self, total=self.total + state.slope * policy.lead_s)


def wanted_replicas(policy: ScalePolicy, current: int, samples: Iterable[LoadSample]) -> int:
    """The count the load asks for right now, before delays: up when the load exceeds the
    target of the current size (or an SLO is breached) and no replica is warming up, down only
    when it fits a smaller size at `scale_down_fill` and none is; otherwise the current count
    (the dead band). Bounded, whole groups, at most `max_step` groups away."""
    return wanted_for(policy, current, Load.of(policy, samples))


def wanted_for(policy: ScalePolicy, current: int, load: Load) -> int:
    """`wanted_replicas` for a load already summed (`Load`)."""
    if load.total is None:
        return current  # nothing trustworthy to go on: hold
    group, total = policy.group_size, load.total
    need = needed(policy, total)
    if load.slo_breached:
        need = max(need, current + group)
    if need > current and load.warming:
        wanted = current  # the last scale-up's replicas are not serving yet: hold
    elif need > current:
        # A step: up to the middle of the dead band, not its top edge: sized at the target
        # exactly, the next swing of the load over it would ask for one more (a second event
        # for one step). A swing (past the target by less than the band): to `swing_fill`
        # of the target (`ScalePolicy.swing_share`).
        fill = policy.middle_fill if is_step(policy, current, total) else policy.swing_share
        wanted = max(need, group * math.ceil(total / (policy.target_load * fill) / group))
    else:
        wanted = current
        # Consolidation: go down a group at a time while the load fits the smaller size with room.
        while (
            not load.warming
            and not load.starting
            and wanted - group >= max(policy.min_replicas, group)
            and total <= ((wanted - group) * policy.target_load * policy.scale_down_fill)
        ):
            wanted -= group
    step = policy.max_step * group
    wanted = min(max(wanted, current - step), current + step)
    return min(max(wanted, policy.min_replicas), policy.max_replicas)


def is_step(policy: ScalePolicy, current: int, total: float) -> bool:
    """Whether `total` is past `current` replicas' target by more than the dead band (the
    share `1 - scale_down_fill` of it): a step of the load, which a flat load's swings do not
    reach, rather than a swing."""
    return total > current * policy.target_load * (2 - policy.scale_down_fill)


def needed(policy: ScalePolicy, total: float) -> int:
    """The fewest replicas (whole groups, at least one) that carry `total` at their target."""
    group = policy.group_size
    return max(group, group * math.ceil(total / policy.target_load / group))


def decide(
    policy: ScalePolicy, state: ScaleState, samples: Iterable[LoadSample], now: float
) -> ScaleState:
    """The next state: `state.replicas` changes only once a change has been wanted for its delay
    and the cool-down since the last change has passed; it goes to the largest count wanted
    meanwhile (`advance`)."""
    return advance_on(policy, state, Load.of(policy, samples, expected=state.replicas), now)


def advance_on(policy: ScalePolicy, state: ScaleState, load: Load, now: float) -> ScaleState:
    """`decide` for a load already summed: its trend read, then the count it asks for
    `lead_s` ahead, through `advance`'s delays."""
    state = state.trended(policy, load, now)
    need = None if load.total is None else needed(policy, load.total)
    # The load ahead sizes a step: a load past the current size's target by more than the dead
    # band is wide (`scale_down_fill`), which a flat load's swings within the band do not
    # reach. Below that a slope is mostly noise: sizing by it would inflate a scale-up the
    # noise began, and a scale-down goes by the load there is.
    stepping = load.total is not None and is_step(policy, state.replicas, load.total)
    wanted = wanted_for(policy, state.replicas, load.ahead(policy, state) if stepping else load)
    state = state.windowed(policy, load, now)
    if wanted == state.replicas:
        # The latest reading keeps the size (above one group less's floor, or nothing warm):
        # a load swinging across that floor may still fit the smaller size over the window.
        smaller = window_allows(policy, state, now)
        if smaller is not None:
            return state.changed_to(smaller, now)
    return advance(policy, state, wanted, now, need)


def window_allows(policy: ScalePolicy, state: ScaleState, now: float) -> int | None:
    """The smaller count the scale-down window allows now (None: none): with
    `scale_down_peak_fill`, once the window spans `downscale_after_s` (its hold) and the
    cool-down has passed, the fewest replicas (whole groups, at most `max_step` groups fewer,
    within the bounds, and no fewer than the last scale-up began from) whose `scale_down_fill`
    of the target holds the readings' mean and whose `scale_down_peak_fill` holds their peak.

    Why: the rule of every reading under one group less's floor (`scale_down_fill`) asks a
    swinging load for a peak under the floor over the whole `downscale_after_s`; a base load
    whose swings cross the floor every few minutes then keeps replicas that a scale-up for one
    of its swings added until the load changes for good. The window's mean keeps the room the
    dead band gives (a flat load at the mean sits there), and its peak at most the target keeps
    the smaller size from a scale-up for swings like those it has just seen (a scale-up needs
    the load past the target). It is only asked when the latest reading keeps the size: a load
    under the floor waits for that rule, whose count goes by the load there is (a load falling
    after a step goes down in one change, not first by what its window's peak allows). And it
    only takes back what the last change, a scale-up, added (`ScaleState.risen_from`): the size
    a scale-down or the start settled at goes lower only by the stricter rule, so a load swinging
    about one level moves the size at most up and back, never down a third time."""
    peak_fill = policy.scale_down_peak_fill
    if peak_fill is None or state.risen_from is None or state.window_since is None:
        return None
    if now - state.window_since < policy.downscale_after_s:
        return None
    if state.cooling(policy, now):
        return None
    mean, peak = state.window_mean_peak()
    group, current = policy.group_size, state.replicas
    floor = max(policy.min_replicas, group, current - policy.max_step * group, state.risen_from)
    count = current
    while (
        count - group >= floor
        and mean <= (count - group) * policy.target_load * policy.scale_down_fill
        and peak <= (count - group) * policy.target_load * peak_fill
    ):
        count -= group
    return count if count < current else None


def advance(
    policy: ScalePolicy, state: ScaleState, wanted: int, now: float, need: int | None = None
) -> ScaleState:
    """`decide`'s delays and cool-down applied to a wanted count; `need`: what the load needs
    at the target (`needed`; default `wanted`), which sets how fast a scale-up's hold fills."""
    current = state.replicas
    if wanted == current:
        return replace(state, wanted=0, wanted_since=None, seen_at=None, surplus=0.0)
    # A change of direction restarts the clock; the same wish keeps it. A scale-up asks for the
    # most it asked for meanwhile: a noisy signal (a rate over a short window) read low at the
    # moment of the change does not size a step short (which a second scale-up would then have
    # to mend). A scale-down goes by the latest reading: its wish began while the load was
    # still falling, and the most it wanted then is not what the load needs now.
    same_direction = state.wanted and (state.wanted > current) == (wanted > current)
    since = state.wanted_since if same_direction and state.wanted_since is not None else now
    # A scale-up's hold is in groups x seconds: each reading adds the groups the load needs
    # beyond the current count (at least one) times the time since the last reading, so a wish
    # for one group more waits `upscale_after_s` and one for k more about 1/k of it: a load
    # that needs many more replicas at once is a step, not noise (noise crosses the target by
    # a group at most), and the sooner its replicas start the less of it waits for them.
    surplus = 0.0
    if wanted > current:
        held = (now - state.seen_at) if same_direction and state.seen_at is not None else 0.0
        groups = (min(wanted if need is None else need, wanted) - current) / policy.group_size
        surplus = (state.surplus if same_direction else 0.0) + held * max(groups, 1.0)
        wanted = max(wanted, state.wanted) if same_direction else wanted
        held_enough = surplus >= policy.upscale_after_s
    else:
        held_enough = now - since >= policy.downscale_after_s
    cooling = state.cooling(policy, now)
    if not held_enough or cooling:
        return replace(state, wanted=wanted, wanted_since=since, seen_at=now, surplus=surplus)
    return state.changed_to(wanted, now)


@dataclass(frozen=True)
class GroupReplicas:
    """The replicas of `groups` groups: each token engine with its shard group."""

    token_engines: int
    shards: int

    @classmethod
    def of(cls, groups: int, shards_per_group: int) -> GroupReplicas:
        return cls(groups, groups * shards_per_group)


def decide_groups(
    policy: ScalePolicy,
    state: ScaleState,
    engine_samples: Iterable[LoadSample],
    shard_samples: Iterable[LoadSample],
    shards_per_group: int,
    now: float,
) -> ScaleState:
    """The next state of a token-engine group count (`state.replicas` counts groups; their
    replicas: `GroupReplicas.of`). Engine samples are in token engines' worth, shard samples in
    shards' worth (a group's is `shards_per_group` of them); the group's load is the larger of
    the two, so a KV-heavy step on the shards adds a whole group even while the engines' decode
    tokens are under target, and a group leaves only when both fit one group less. `policy`
    counts groups (`group_size` 1; bounds and `max_step` in groups)."""
    if policy.group_size != 1:
        raise ValueError("a group policy counts groups: group_size must be 1")
    load = Load.of(policy, engine_samples, expected=state.replicas)
    if shards_per_group:
        shards = Load.of(policy, shard_samples, per=shards_per_group,
                         expected=state.replicas * shards_per_group)  # fmt: skip
        load = load | shards
    return advance_on(policy, state, load, now)
