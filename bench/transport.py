"""Transport bench: UCX tensor channel vs ZeroMQ, side by side in one run (two processes each).

(a) per-layer shard round trip: q [32, 2, 64] fp32 out, attention output [32, 2, 64] + lse [32, 2]
    back, over `UcxTensorChannel`, over `ZmqTensorChannel`, and over a plain zmq DEALER/ROUTER pair
    with the same bytes (the floor the wrappers are judged against: ratio row 4 of
    shared/reference/performance-limits.md). The reply lands in preallocated tensors, as a token
    engine receives a shard's output in place.
(b) bulk: 1 MiB and 16 MiB tensors one way plus a small ack, into preallocated receive buffers, over
    the same three; with an in-process memcpy of the same bytes as the same-run ceiling.
(c) the price of the control plane's CURVE (common/transport/zmq_auth.py): the plain zmq pair again
    as a CURVE server and client (`curve_zmq`): every message encrypted and authenticated, as mesh
    control messages and ZeroMQ-borne KV pages are.

Transports are interleaved repeat by repeat so that noise from other work hits all of them alike.
The client and every server are pinned to two different cores (`--cores CLIENT SERVER`), as the
launcher places a token engine and its first shard: where the two ends run moves a round trip
more than the transport does (docs/mesh.md).
Prints a table; the last line is one JSON object with medians (over repeats) and ratios.
Usage: PYTHONPATH=. .venv/bin/python bench/transport.py [--repeats 5] [--ucx-tls tcp,sm ...]
                                                         [--cores CLIENT SERVER]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import msgspec
import torch
import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.transport.tensor_frames import TensorSpec  # noqa: E402
from common.transport.zmq_auth import CurveKeys  # noqa: E402
from common.transport.zmq_tensor import ZmqTensorChannel  # noqa: E402
from services.launch.core_pinning import pin_this_process  # noqa: E402

NUM_SEQS, NUM_HEADS, HEAD_DIM = 32, 2, 64
# A per-layer round trip over UCX within 1.5x of plain zmq's (shared/reference/
# performance-limits.md, row 4). CURVE: a control message's round trip within 1.5x of plain zmq's;
# its bulk rate is the cipher's (a core's worth), a guard against falling further while KV
# pages still travel over ZeroMQ (issue 25 moves them to UCX, authenticated but not encrypted).
TARGETS = {
    "ucx_rtt_vs_plain_zmq": 1.5,
    "curve_rtt_vs_plain_zmq": 1.5,
    "curve_1MiB_rate_vs_plain_zmq": 0.15,
}
BENCH_MESH = CurveKeys.from_mesh_key("b0" * 32)  # one key for the bench's processes
BULK_SIZES = {"1MiB": 1 << 20, "16MiB": 16 << 20}


class Probe(msgspec.Struct, array_like=True, gc=False):
    """The bench header: what the server should do with this message."""

    phase: str  # "rtt" | bulk size name | "stop"
    seq: int = 0


def server_buffers() -> dict[str, list[torch.Tensor]]:
    buffers = {"rtt": [torch.empty(NUM_SEQS, NUM_HEADS, HEAD_DIM)]}
    buffers |= {name: [torch.zeros(n // 4)] for name, n in BULK_SIZES.items()}  # pre-touched
    return buffers


def serve_channel(channel: Any, preallocated: bool) -> None:
    """Echo server for the tensor channels: reply out+lse to "rtt", an empty ack to bulk.

    UCX receives into preallocated buffers (its zero-copy path); zmq into tensors over the received
    frames (its zero-copy path; copying into preallocated buffers would add a memcpy)."""
    buffers = server_buffers()
    reply = [torch.randn(NUM_SEQS, NUM_HEADS, HEAD_DIM), torch.randn(NUM_SEQS, NUM_HEADS)]

    def pick(header: Probe, specs: list[TensorSpec]) -> list[torch.Tensor]:
        return buffers.get(header.phase, [])

    while True:
        header, _ = channel.recv(out=pick if preallocated else None, timeout=120)
        if header.phase == "stop":
            break
        channel.send(header, reply if header.phase == "rtt" else [])
    channel.close()


def ucx_server(tls: str, address_queue: Any) -> None:
    os.environ["PHASEMESH_UCX_TLS"] = tls
    from common.transport.ucx_listener import UcxListener

    listener = UcxListener(Probe)
    address_queue.put(listener.address)
    serve_channel(listener.accept(timeout=60), preallocated=True)


def zmq_channel_server(address_queue: Any) -> None:
    channel = ZmqTensorChannel("tcp://127.0.0.1:*", Probe, bind=True)
    address_queue.put(channel.endpoint)
    serve_channel(channel, preallocated=False)


def plain_zmq_server(curve: bool, address_queue: Any) -> None:
    """ROUTER echo with raw frames: the same bytes, no wrapper, no msgspec envelope decoding;
    a CURVE server with `curve`."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    if curve:
        BENCH_MESH.serve(sock)
    address_queue.put(f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}")
    reply = [torch.randn(NUM_SEQS, NUM_HEADS, HEAD_DIM), torch.randn(NUM_SEQS, NUM_HEADS)]
    reply_frames = [t.numpy() for t in reply]
    while True:
        identity, phase, *_ = sock.recv_multipart(copy=False)
        if phase.bytes == b"stop":
            break
        frames = reply_frames if phase.bytes == b"rtt" else []
        sock.send_multipart([identity, phase, *frames], copy=False)
    sock.close(linger=0)


def run_pinned(cores: list[int], target: Callable[..., None], *args: Any) -> None:
    if cores:
        pin_this_process(cores)
    target(*args)


def start_server(cores: list[int], target: Callable[..., None], *args: Any) -> tuple[Any, str]:
    # Forked by multiprocessing's fork server, as `LocalMesh` workers are: a fresh interpreter
    # per server would spend seconds importing torch and ucxx before it served anything.
    ctx = mp.get_context("forkserver")
    queue = ctx.Queue()
    proc = ctx.Process(target=run_pinned, args=(cores, target, *args, queue), daemon=True)
    proc.start()
    return proc, queue.get(timeout=60)


class PlainZmqClient:
    """The client half of the plain zmq baseline, with the `send`/`recv` shape of the channels."""

    def __init__(self, endpoint: str, curve: bool = False) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        if curve:
            BENCH_MESH.join(self.sock)
        self.sock.connect(endpoint)

    def send(self, header: Probe, tensors: list[torch.Tensor]) -> None:
        frames = [header.phase.encode(), *(t.numpy() for t in tensors)]
        self.sock.send_multipart(frames, copy=False)

    def recv(self, out: Any = None, timeout: float = 60) -> tuple[Any, list[Any]]:
        if not self.sock.poll(int(timeout * 1000)):
            raise TimeoutError("plain zmq server did not answer")
        return None, self.sock.recv_multipart(copy=False)

    def close(self) -> None:
        self.sock.close(linger=0)


def time_round_trips(
    client: Any, phase: str, tensors: list[torch.Tensor], n: int, out: Any = None
) -> float:
    """Median seconds of `n` send + reply round trips; replies land in `out` if given."""
    samples = []
    for i in range(n):
        start = time.perf_counter()
        client.send(Probe(phase, i), tensors)
        client.recv(out=out, timeout=60)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def memcpy_seconds(nbytes: int, n: int = 20) -> float:
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    dst.copy_(src)
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        dst.copy_(src)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def run_repeats(clients: dict[str, Any], repeats: int, n_rtt: int) -> dict[str, list[float]]:
    """Per transport and probe, one median per repeat; transports interleaved in every repeat."""
    q = torch.randn(NUM_SEQS, NUM_HEADS, HEAD_DIM)
    reply_buffers = [torch.empty(NUM_SEQS, NUM_HEADS, HEAD_DIM), torch.empty(NUM_SEQS, NUM_HEADS)]
    bulk = {name: torch.randn(n // 4) for name, n in BULK_SIZES.items()}
    results: dict[str, list[float]] = {}
    for _ in range(repeats + 1):  # the first repeat warms up connections and pages
        for transport, client in clients.items():
            # Like a token engine, which receives each shard's output in place.
            sample = {"rtt": time_round_trips(client, "rtt", [q], n_rtt, out=reply_buffers)}
            for name, tensor in bulk.items():
                n_bulk = 20 if name == "1MiB" else 6
                sample[name] = time_round_trips(client, name, [tensor], n_bulk)
            for probe, seconds in sample.items():
                results.setdefault(f"{transport}:{probe}", []).append(seconds)
    return {key: values[1:] for key, values in results.items()}


def summarize(results: dict[str, list[float]], tls_list: list[str]) -> dict[str, Any]:
    med = {key: statistics.median(v) for key, v in results.items()}
    summary: dict[str, Any] = {"rtt_us": {}, "bulk_GBps": {}, "ratios": {}}
    for key, seconds in med.items():
        transport, probe = key.split(":")
        if probe == "rtt":
            summary["rtt_us"][transport] = round(seconds * 1e6, 1)
        else:
            rate = BULK_SIZES[probe] / seconds / 1e9
            summary["bulk_GBps"][f"{transport}:{probe}"] = round(rate, 3)
    ratios = summary["ratios"]
    for transport in [f"ucx[{tls}]" for tls in tls_list] + ["zmq_channel", "curve_zmq"]:
        ratios[f"{transport}_rtt_vs_plain_zmq"] = round(
            med[f"{transport}:rtt"] / med["plain_zmq:rtt"], 3
        )
        for probe in BULK_SIZES:
            ratios[f"{transport}_{probe}_rate_vs_plain_zmq"] = round(
                med[f"plain_zmq:{probe}"] / med[f"{transport}:{probe}"], 3
            )
    for probe, nbytes in BULK_SIZES.items():
        summary["bulk_GBps"][f"memcpy:{probe}"] = round(nbytes / memcpy_seconds(nbytes) / 1e9, 2)
    return summary


def print_table(results: dict[str, list[float]]) -> None:
    print(f"{'transport:probe':34} {'median':>12} {'min':>12} {'max':>12}  (per repeat)")
    for key, values in results.items():
        unit, scale = ("us", 1e6) if key.endswith(":rtt") else ("ms", 1e3)
        stats = [statistics.median(values), min(values), max(values)]
        print(f"{key:34} " + " ".join(f"{v * scale:10.1f}{unit}" for v in stats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--round-trips", type=int, default=300)
    parser.add_argument("--ucx-tls", nargs="+", default=["tcp"])
    parser.add_argument(
        "--cores", type=int, nargs=2, metavar=("CLIENT", "SERVER"),
        help="pin the client and every server (default: two different cores, as a token engine "
        "and its first shard are placed; the same core twice measures a same-core hand-off)",
    )  # fmt: skip
    args = parser.parse_args()
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    # Where the two ends run decides the round trip more than the transport does (a cross-core
    # hand-off costs more each way than a same-core one); left to the OS, each transport would
    # draw its own placement.
    available = sorted(os.sched_getaffinity(0))
    client_core, server_core = args.cores or (available[-1], available[0])
    pin = len(available) > 1 or args.cores is not None
    if pin:
        pin_this_process([client_core])
    server_cores = [server_core] if pin else []
    torch.set_num_threads(1)
    from common.transport.ucx_channel import UcxTensorChannel, ucx_settings

    servers, clients = [], {}
    for tls in args.ucx_tls:
        proc, address = start_server(server_cores, ucx_server, tls)
        os.environ["PHASEMESH_UCX_TLS"] = tls  # read when this process's worker is built
        servers.append(proc)
        clients[f"ucx[{tls}]"] = UcxTensorChannel.connect(address, Probe)
    proc, endpoint = start_server(server_cores, zmq_channel_server)
    servers.append(proc)
    clients["zmq_channel"] = ZmqTensorChannel(endpoint, Probe, bind=False)
    for name, curve in (("plain_zmq", False), ("curve_zmq", True)):
        proc, endpoint = start_server(server_cores, plain_zmq_server, curve)
        servers.append(proc)
        clients[name] = PlainZmqClient(endpoint, curve)

    results = run_repeats(clients, args.repeats, args.round_trips)
    for client in clients.values():
        client.send(Probe("stop"), [])
        client.close()
    for proc in servers:
        proc.join(timeout=10)
    print_table(results)
    summary = summarize(results, args.ucx_tls)
    summary["ucx_settings"] = ucx_settings()
    summary["cores"] = {"client": client_core, "server": server_core}
    summary["load_avg_1m"] = os.getloadavg()[0]
    ratios = summary["ratios"]
    summary["targets"] = TARGETS
    summary["targets_met"] = {
        "ucx_rtt_vs_plain_zmq": ratios[f"ucx[{args.ucx_tls[0]}]_rtt_vs_plain_zmq"]
        <= TARGETS["ucx_rtt_vs_plain_zmq"],
        "curve_rtt_vs_plain_zmq": ratios["curve_zmq_rtt_vs_plain_zmq"]
        <= TARGETS["curve_rtt_vs_plain_zmq"],
        "curve_1MiB_rate_vs_plain_zmq": ratios["curve_zmq_1MiB_rate_vs_plain_zmq"]
        >= TARGETS["curve_1MiB_rate_vs_plain_zmq"],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
