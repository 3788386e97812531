"""`kill_session` (tests/e2e/serve_process.py), which every `serve run` the tests and the served
benches start is stopped with: it must reach a process of the session that no process tree holds
any more, as a Ray worker whose parent died, or a replica Serve started after the last look at
the tree, would be."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.serve_process import alive, kill_session, session_pids


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_kill_session_reaches_an_orphan_of_a_session_whose_leader_has_exited(
    tmp_path: Path,
) -> None:
    """A session leader starts a process in a process group of its own (as Ray does with its
    workers) and exits: the process is reparented out of the leader's tree and out of its group,
    but stays in its session. `kill_session` of the leader's id ends it."""
    pid_file = tmp_path / "orphan.pid"
    start_orphan = (
        "import subprocess, sys; "
        "p = subprocess.Popen(['sleep', '600'], process_group=0); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))"
    )
    leader = subprocess.Popen([sys.executable, "-c", start_orphan], start_new_session=True)
    assert leader.wait(30) == 0  # the leader is gone; its child lives on
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline, "the orphan never wrote its pid"
        time.sleep(0.05)
    orphan = int(pid_file.read_text())
    assert alive(orphan) and orphan in session_pids(leader.pid)
    ppid, pgrp = Path(f"/proc/{orphan}/stat").read_text().rsplit(")", 1)[1].split()[1:3]
    assert int(ppid) != leader.pid and int(pgrp) == orphan  # neither its tree nor its group

    kill_session(leader.pid)

    assert not alive(orphan)
    assert session_pids(leader.pid) == []
