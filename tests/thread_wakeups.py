"""How often a thread has blocked and been woken (Linux /proc): what an idle loop's timer costs,
for tests that check an idle part sleeps instead of waking on a clock."""

from __future__ import annotations

import threading
from pathlib import Path


def thread_wakeups(thread: threading.Thread) -> int:
    """The voluntary context switches of `thread` (of this process) so far."""
    status = Path(f"/proc/self/task/{thread.native_id}/status").read_text()
    return int(status.split("voluntary_ctxt_switches:", 1)[1].split()[0])
