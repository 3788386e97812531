"""`tests/e2e/serve_process.ServeRun`'s ports: picked below the kernel's ephemeral range, and a
start whose HTTP port another process took meanwhile tried again on a fresh one.

`serve run` itself is a stand-in here (`FAKE_SERVE_CLI`: a real process that binds the config's
port and answers `/health`, or says what Serve's proxy says when the port is busy): a real Ray
start per case would cost this unit test a minute."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
import yaml

from tests.e2e import serve_process
from tests.e2e.serve_process import PORT_TAKEN, PORT_TRIES, REPO, ServeExited, ServeRun, free_port

FAKE_SERVE_CLI = f"""#!{sys.executable}
import http.server, sys, yaml
from pathlib import Path
here = Path(__file__).parent
with (here / "starts").open("a") as starts:
    starts.write("start\\n")
if (here / "fail").exists():
    sys.exit("RuntimeError: the application failed to build")
port = yaml.safe_load(open(sys.argv[-1]))["http_options"]["port"]

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass

try:
    server = http.server.HTTPServer(("127.0.0.1", port), Health)
except OSError:
    sys.exit("RuntimeError: {PORT_TAKEN} '127.0.0.1:%d'." % port)
server.serve_forever()
"""


@pytest.fixture
def fake_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The stand-in, in a folder of its own; it counts its starts in `starts` there."""
    folder = tmp_path / "cli"
    folder.mkdir()
    cli = folder / "serve"
    cli.write_text(FAKE_SERVE_CLI)
    cli.chmod(0o755)
    monkeypatch.setattr(serve_process, "SERVE_CLI", cli)
    return folder


def starts(folder: Path) -> int:
    return len((folder / "starts").read_text().splitlines())


def ephemeral_low() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_free_ports_lie_below_the_kernels_ephemeral_range() -> None:
    for _ in range(20):
        port = free_port()
        assert port < ephemeral_low()
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free when picked


def test_a_start_whose_port_was_taken_moves_to_a_fresh_one(fake_cli: Path, tmp_path: Path) -> None:
    run = ServeRun(REPO / "deploy" / "single.yaml", tmp_path, ingress="proxy")
    taken = run.port
    with socket.socket() as holder:  # another process's server, bound meanwhile
        holder.bind(("127.0.0.1", taken))
        holder.listen()
        try:
            url = run.start(timeout_s=60)
        finally:
            run.kill()
    assert starts(fake_cli) == 2
    assert run.port != taken and url == run.proxy_url == f"http://127.0.0.1:{run.port}"
    assert yaml.safe_load(run.config_path.read_text())["http_options"]["port"] == run.port


def test_a_start_fails_after_its_tries_or_at_once_for_another_reason(
    fake_cli: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    holders: list[socket.socket] = []

    def taken(port: int) -> int:
        """`port`, bound and listening by another server before the start gets to it."""
        holder = socket.socket()
        holders.append(holder)
        holder.bind(("127.0.0.1", port))
        holder.listen()
        return port

    run = ServeRun(REPO / "deploy" / "single.yaml", tmp_path, ingress="proxy")
    try:
        taken(run.port)
        monkeypatch.setattr(serve_process, "free_port", lambda: taken(free_port()))
        with pytest.raises(ServeExited, match=PORT_TAKEN):
            run.start(timeout_s=60)
        assert starts(fake_cli) == PORT_TRIES
        # Another failure is the start's own: not tried again.
        (fake_cli / "fail").touch()
        with pytest.raises(ServeExited, match="failed to build"):
            run.start(timeout_s=60)
        assert starts(fake_cli) == PORT_TRIES + 1
    finally:
        run.kill()
        for holder in holders:
            holder.close()
