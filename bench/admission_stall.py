"""Admission stall: do requests already decoding slow down when a newcomer joins (Lamina §5)?

    python bench/admission_stall.py [--residents 4] [--newcomers 12] [--newcomer-prompt 512]
                                    [--shards-per-group 2]

For each KV transfer (`push`: prompt engines ship KV into the shards while they decode; `pull`:
shards fetch it between decode steps, and the token engine admits the newcomer once it landed on
every shard), on the same launched mesh shape (1 prompt engine, 2 token engines with 2 shards each,
`--shards-per-group`): `--residents` requests decode on the first group for the whole run while
`--newcomers` requests join them one at a time, each with a long prompt and a few tokens,
`--quiet-s` apart.

A newcomer's admission window runs from its first token (prefill done, KV shipped or held) to its
second (its first decode step on the token engine). The residents' token gaps that end inside a
window are admission gaps. The gap with no admission they are held against is the residents' gaps
ending at the newcomer's later tokens: the same batch (the newcomer in it, its long context
included) with nothing being admitted. `ratio` is the median over newcomers of each one's
admission gap over its own no-admission gap (raw).

The raw ratio is not the stall Lamina §5 is about. On a few shared cores the newcomer's prefill
(the prompt engine's compute, and its KV leaving) takes CPU from the decode group however KV
travels, and the residents' gap that straddles the first token carries it. So between admitted
newcomers the run sends two kinds of same-size controls to the *other* group (pinned to the same
cores: core_pinning.py), prefilled by the same prompt engine: `elsewhere` ones are admitted and
decode one step there (the machine's same work, none of it in our group's steps, plus one step
there that the admitted case does not have), `prefill_only` ones end at their first token (their
KV may not finish moving). A control's ratio is the residents' gap in the window at the admitted
newcomers' median offsets from the first token over the gap after it. `isolated_ratio` = raw
ratio / the prefill-only control's ratio: the target, as the stricter of the two (that control
carries less contention); `isolated_vs_elsewhere` = raw ratio / the elsewhere control's (errs
low). Either says what admitting into this group (KV landing in its shards mid-step or between
steps, the token engine's admission) adds beyond the machine prefilling a newcomer somewhere.
Also printed: quiet gaps, which touch no newcomer at all. Figures are medians over newcomers of
the per-window mean (and max), at the router's own client: one over each group (a view of the
mesh without the other group's token engine), so JSQ places every request where it belongs.

The last line is JSON with the ratios and `targets`: pull's isolated admission gap within 10% of
the gap with no admission. Timings on a shared machine with few cores are noisy: the load
average is printed beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.mesh_options import MeshOptions  # noqa: E402
from common.model.default import default_model_path  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402
from services.launch.local_mesh import LocalMesh, Topology  # noqa: E402
from services.mesh.registry import ServiceEntry  # noqa: E402
from services.router.mesh_client import MeshEngineClient  # noqa: E402
from tests.conftest import random_prompts  # noqa: E402

Span = tuple[float, float]
NEWCOMER = SamplingParams(max_tokens=5, ignore_eos=True)  # 1 from prefill, then 4 decode steps
ELSEWHERE = SamplingParams(max_tokens=2, ignore_eos=True)  # one decode step, in the other group
PREFILL_ONLY = SamplingParams(max_tokens=1, ignore_eos=True)  # done at its first token
TIMEOUT_S = 120.0  # the most a wait for tokens may take


def run_arm(args: argparse.Namespace, kv_transfer: str) -> dict[str, float]:
    topology = Topology(
        str(default_model_path(args.model)), num_prompt=1, num_token=2,
        num_shards=2 * args.shards_per_group,
        options=MeshOptions(num_blocks=2048, shard_num_blocks=2048, kv_transfer=kv_transfer),
    )  # fmt: skip
    mesh = LocalMesh.start(topology)
    try:
        ours, elsewhere = mesh.token
        here = mesh.engine_client(without(mesh, elsewhere))
        there = mesh.engine_client(without(mesh, ours))
        try:
            return asyncio.run(measure(here, there, args))
        finally:
            here.shutdown()
            there.shutdown()
    finally:
        mesh.close()


def without(mesh: LocalMesh, token: ServiceEntry) -> Callable[[], list[ServiceEntry]]:
    """The mesh's live services but token engine `token`: a client over them never places there."""
    return lambda: [s for s in mesh.registry.live() if s.service_id != token.service_id]


class TokenTimes:
    """Each request's token arrival times (`time.monotonic`), and a wait on them."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}
        self.error: BaseException | None = None  # a request that failed: every wait raises it
        self._changed = asyncio.Condition()

    async def run(
        self, client: MeshEngineClient, req_id: str, prompt: list[int], params: SamplingParams
    ) -> list[float]:
        """Run one request to its end (or until cancelled: an abort), stamping its tokens."""
        stamps = self.times.setdefault(req_id, [])
        try:
            async for out in client.generate(req_id, prompt, params):
                if out.error:
                    raise RuntimeError(f"{req_id} failed: {out.error}")
                stamps += [time.monotonic()] * len(out.new_token_ids)
                async with self._changed:
                    self._changed.notify_all()
        except Exception as exc:
            self.error = exc
            async with self._changed:
                self._changed.notify_all()
            raise
        return stamps

    async def wait(self, done: Callable[[], bool]) -> None:
        async with asyncio.timeout(TIMEOUT_S), self._changed:
            await self._changed.wait_for(lambda: self.error is not None or done())
        if self.error is not None:
            raise self.error


async def measure(
    ours: MeshEngineClient, elsewhere: MeshEngineClient, args: argparse.Namespace
) -> dict[str, float]:
    """Residents decode on `ours`'s group; admitted newcomers join them; the controls,
    alternating with them, decode on `elsewhere`'s (see the module docstring)."""
    n, k = args.residents, args.newcomers
    lengths = [args.resident_prompt] * n + [args.newcomer_prompt] * (3 * k)
    prompts = random_prompts(lengths, 2048, seed=7)  # all different: no prefix cache hits
    endless = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
    stamps = TokenTimes()
    resident_times: list[list[float]] = [stamps.times.setdefault(f"resident-{i}", [])
                                         for i in range(n)]  # fmt: skip
    residents = [asyncio.create_task(stamps.run(ours, f"resident-{i}", prompts[i], endless))
                 for i in range(n)]  # fmt: skip
    await stamps.wait(lambda: min(map(len, resident_times)) >= 16)
    windows: list[list[float]] = []
    controls: dict[str, list[list[float]]] = {"elsewhere": [], "prefill_only": []}
    busy = []
    for j in range(3 * k):
        kind = ("admitted", "elsewhere", "prefill_only")[j % 3]
        params = {"admitted": NEWCOMER, "elsewhere": ELSEWHERE}.get(kind, PREFILL_ONLY)
        submitted = time.monotonic()
        client = ours if kind == "admitted" else elsewhere
        async with asyncio.timeout(TIMEOUT_S):
            times = await stamps.run(client, f"{kind}-{j}", prompts[n + j], params)
        (windows if kind == "admitted" else controls[kind]).append(times)
        busy.append((submitted, times[-1]))
        await asyncio.sleep(args.quiet_s)  # the residents decode on, with nothing admitted
    if stamps.error is not None:
        raise stamps.error
    for task in residents:
        task.cancel()  # each aborts its request at its engines
    await asyncio.gather(*residents, return_exceptions=True)
    gaps = [(a, b) for times in resident_times for a, b in _pairs(times)]
    return summarize(gaps, windows, busy, controls)


def summarize(
    gaps: list[Span],
    newcomers: list[list[float]],
    busy: list[Span],
    controls: dict[str, list[list[float]]],
) -> dict[str, float]:
    """`newcomers`: each admitted newcomer's token times, `controls` each control's by kind (its
    first token is what counts); see the module docstring."""
    quiet = [b - a for a, b in gaps if not any(a < e and b > s for s, e in busy)]
    means, maxes, after, ratios = [], [], [], []
    for t in newcomers:
        inside = _gaps_ending(gaps, t[0], t[1])
        later = _gaps_ending(gaps, t[1], t[-1])
        if inside and later:
            means.append(statistics.mean(inside))
            maxes.append(max(inside))
            after.append(statistics.mean(later))
            ratios.append(means[-1] / after[-1])  # each window against its own batch: load drifts
    # The control's windows sit at the admitted newcomers' offsets from the first token.
    window = statistics.median(t[1] - t[0] for t in newcomers)
    rest = statistics.median(t[-1] - t[1] for t in newcomers)
    control = {kind: _control_ratio(gaps, c, window, rest) for kind, c in controls.items()}
    ratio = _median(ratios)
    return {
        "admission_gap_ms": round(1e3 * _median(means), 3),
        "admission_max_gap_ms": round(1e3 * _median(maxes), 3),
        "no_admission_gap_ms": round(1e3 * _median(after), 3),
        "quiet_gap_ms": round(1e3 * _median(quiet), 3),
        "ratio": round(ratio, 4),
        "elsewhere_ratio": round(control["elsewhere"], 4),
        "prefill_only_ratio": round(control["prefill_only"], 4),
        "isolated_ratio": round(ratio / control["prefill_only"], 4),
        "isolated_vs_elsewhere": round(ratio / control["elsewhere"], 4),
        "num_quiet_gaps": len(quiet),
        "num_windows": len(means),
    }


def _control_ratio(gaps: list[Span], controls: list[list[float]], window: float, rest: float):  # noqa: ANN202
    """The median over controls of the residents' gap in the window at the admitted newcomers'
    offsets from the first token, over the gap after it."""
    ratios = []
    for first, *_ in controls:
        inside = _gaps_ending(gaps, first, first + window)
        later = _gaps_ending(gaps, first + window, first + window + rest)
        if inside and later:
            ratios.append(statistics.mean(inside) / statistics.mean(later))
    return _median(ratios)


def _median(values: list[float]) -> float:
    """The median, NaN for no values (a short run whose windows saw no gap on both sides: its
    figures say so and its targets are not met, rather than the bench failing)."""
    return statistics.median(values) if values else math.nan


def _gaps_ending(gaps: list[Span], start: float, end: float) -> list[float]:
    return [b - a for a, b in gaps if start < b <= end]


def _median_arm(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: round(statistics.median(run[key] for run in runs), 4) for key in runs[0]}


def _pairs(stamps: list[float]) -> list[Span]:
    return [(a, b) for a, b in zip(stamps, stamps[1:], strict=False) if b > a]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--residents", type=int, default=4)
    p.add_argument("--resident-prompt", type=int, default=64)
    p.add_argument("--newcomers", type=int, default=12)
    p.add_argument("--newcomer-prompt", type=int, default=512)
    p.add_argument("--quiet-s", type=float, default=0.3)
    p.add_argument("--shards-per-group", type=int, default=2, help="each token engine's shards")
    p.add_argument("--rounds", type=int, default=1, help="push, pull, push, pull, ...: the "
                   "figures are medians over rounds (load on a shared machine drifts)")  # fmt: skip
    return p.parse_args()


def main() -> None:
    args = parse_args()
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    rounds = [{mode: run_arm(args, mode) for mode in ("push", "pull")} for _ in range(args.rounds)]
    arms = {mode: _median_arm([r[mode] for r in rounds]) for mode in ("push", "pull")}
    for mode, arm in arms.items():
        print(f"{mode}: gap while a newcomer is admitted {arm['admission_gap_ms']} ms (max "
              f"{arm['admission_max_gap_ms']} ms), same batch with no admission "
              f"{arm['no_admission_gap_ms']} ms, raw ratio {arm['ratio']}; controls: "
              f"admitted elsewhere {arm['elsewhere_ratio']}, prefill-only "
              f"{arm['prefill_only_ratio']}; isolated ratio {arm['isolated_ratio']} (against "
              f"admitted elsewhere {arm['isolated_vs_elsewhere']}); quiet gap "
              f"{arm['quiet_gap_ms']} ms")  # fmt: skip
    result = {
        "arms": arms,
        "pull_over_push_admission_gap": round(
            arms["pull"]["admission_gap_ms"] / arms["push"]["admission_gap_ms"], 4
        ),
        "loadavg_before": load_before,
        "loadavg_after": Path("/proc/loadavg").read_text().split()[:3],
        "ratios_by_round": [
            {
                m: {k: r[m][k] for k in ("ratio", "isolated_ratio", "isolated_vs_elsewhere")}
                for m in r
            }
            for r in rounds
        ],
        "targets": {"pull_isolated_admission_gap_vs_no_admission": "<= 1.10"},
    }
    met = arms["pull"]["isolated_ratio"] <= 1.10
    result["targets_met"] = {"pull_isolated_admission_gap_vs_no_admission": met}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
