"""Keep Python's full garbage collections off a serving loop's hot path.

A process that imported torch, our model code and its libraries holds hundreds of thousands of
objects before it serves anything (a Serve replica more than a bare mesh worker), and each full
(generation 2) collection walks all of them, a pause many decode steps long (`gc.callbacks` can
time it). Python starts one whenever enough new objects have survived, so a decode loop that
allocates per step gets such a stall every so often, on every stream it carries (a token-to-token
gap), and a load generator gets one in its measurements.

`freeze_startup_heap()` collects once and moves every live object into the permanent generation
(`gc.freeze`), which later collections skip: after it a full collection walks only what the
process allocated since, and is short. Ray Serve does the same for its replicas once their
constructor returns (`RAY_SERVE_FREEZE_GC_ON_STARTUP`, on by default), as vLLM does after its
start-up; this module is for the processes Serve does not start: the local launcher's workers,
the load generator and the benchmarks' clients. Objects frozen are still freed by reference
counting; only reference cycles among them are never collected, hence the collection first.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect, then freeze everything alive; returns how many objects are now frozen. Call once,
    when start-up is done and before the loop that must not stall."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
