"""The csrc kernels' own worker pool (csrc/thread_pool.h): the projections' GEMM and the decode
attention split their work over it. Outputs never depend on who ran a unit, an idle pool costs
no CPU, and a forked child gets a pool of its own."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest
import torch
from torch.utils.dlpack import to_dlpack

from common.attention.cpu_kernel import extension, kernel_available
from common.model.linear import PackedLinear
from tests.kernel_gate import kernel_gate

_EXT = extension() if kernel_available() else None
pytestmark = kernel_gate(
    "csrc extension without its worker pool", built=hasattr(_EXT, "pool_workers")
)


def _layers() -> list[PackedLinear]:
    torch.manual_seed(0)
    layers = []
    for weight_dtype in ("float32", "bfloat16", "int8"):
        layer = PackedLinear(96, 640, bias=False).requires_grad_(False)
        layer.pack(weight_dtype=weight_dtype)
        assert layer.panels is not None
        layers.append(layer)
    return layers


def _outputs(layers: list[PackedLinear], x: torch.Tensor) -> list[torch.Tensor]:
    residual = torch.ones(x.shape[0], 640)
    outs = []
    for layer in layers:
        outs += [layer.forward(x), layer.forward_add(x, residual), layer.forward_silu_and_mul(x)]
    return outs


@pytest.fixture
def spin_us():
    """Restores the pool's spin after a test that changes it."""
    before = _EXT.pool_spin_us()
    yield before
    _EXT.pool_spin_us(before)


@pytest.mark.parametrize("spin", [0, 200])
def test_outputs_are_the_one_thread_bits_at_any_thread_count_and_spin(spin_us, spin):
    """Whether the workers are awake (spin) or asleep (0: each call wakes them and goes on
    without them), and however many take part, every output is the one-thread call's bits."""
    layers = _layers()
    xs = [torch.randn(rows, 96) for rows in (1, 7, 70)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [_outputs(layers, x) for x in xs]
        _EXT.pool_spin_us(spin)
        for count in (2, 3):
            torch.set_num_threads(count)
            for _ in range(5):
                for x, want in zip(xs, alone, strict=True):
                    for got, expected in zip(_outputs(layers, x), want, strict=True):
                        assert torch.equal(got, expected)
    finally:
        torch.set_num_threads(threads)
    assert _EXT.pool_workers() >= 2  # three threads asked: two workers beside the caller
    assert _EXT.pool_spin_us() == spin


def _other_runnable_threads() -> int:
    """Threads of this process running or waiting for a core, the caller left out: a spinning
    worker counts whatever the machine's load (it yields its core, and stays runnable); a
    sleeping one does not."""
    runnable = 0
    for stat in Path("/proc/self/task").glob("*/stat"):
        try:
            state = stat.read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # a thread that ended meanwhile
        runnable += state == "R"
    return runnable - 1


def test_an_idle_pool_costs_no_cpu(spin_us):
    """After a call, the workers spin for `pool_spin_us` at most, then sleep: a process whose
    kernels went quiet uses no CPU. A spin longer than the wait shows the probe sees spinning."""
    layer = _layers()[2]
    x = torch.randn(1, 96)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:

        def calls() -> None:
            for _ in range(20):
                layer.forward(x)

        _EXT.pool_spin_us(2_000_000)
        calls()
        spinning = max(_other_runnable_threads() for _ in range(20))
        _EXT.pool_spin_us(200)
        calls()
        start = time.process_time()
        time.sleep(0.5)
        idle_cpu_s = time.process_time() - start
    finally:
        torch.set_num_threads(threads)
    assert _EXT.pool_workers() >= 1
    assert idle_cpu_s < 0.02, idle_cpu_s
    # NOTE: by state, not CPU: a spinning worker yields its core to any runnable process, so on
    # a loaded machine its CPU time is near nothing (a CI run saw under 0.02 s in 0.5 s).
    assert spinning >= 1, spinning


def _kernel_forward(layer: PackedLinear, x: torch.Tensor, num_threads: int) -> torch.Tensor:
    """The extension's GEMM called directly with `num_threads`: no torch op that runs on torch's
    OpenMP pool (libgomp hangs in a forked child that uses it after the parent did)."""
    out = torch.empty(x.shape[0], layer.out_features)
    _EXT.linear(
        to_dlpack(x), to_dlpack(layer.panels), to_dlpack(out), None, 0, num_threads,
        scales=to_dlpack(layer.scales),
    )  # fmt: skip
    return out


def _child_forward(layer: PackedLinear, x: torch.Tensor, queue) -> None:  # type: ignore[no-untyped-def]
    before = _EXT.pool_workers()  # none: the parent's are not here
    out = _kernel_forward(layer, x, 2)
    queue.put((before, _EXT.pool_workers(), out.tolist()))  # plain data: no torch sharing


def test_a_forked_child_gets_a_pool_of_its_own():
    """The parent's workers do not exist in a forked child: its calls start their own (a child
    that waited for the parent's would hang; the get's timeout is the hang guard)."""
    layer, x = _layers()[2], torch.randn(3, 96)
    want = _kernel_forward(layer, x, 2)  # the parent's pool is up
    assert _EXT.pool_workers() >= 1
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child_forward, args=(layer, x, queue))
    child.start()
    try:
        before, after, got = queue.get(timeout=60)
    finally:
        child.join(timeout=30)
        if child.exitcode is None:
            child.kill()
    assert child.exitcode == 0
    assert (before, after) == (0, 1)
    assert got == want.tolist()
