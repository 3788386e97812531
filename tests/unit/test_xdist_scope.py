"""`make test`'s two workers each take whole units (tests/conftest.py): a module, or every e2e
module together (each starts a Ray cluster: one at a time) but the few that go out last, each
a unit of its own."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

from tests.conftest import (
    E2E,
    E2E_LAST,
    pytest_collection_modifyitems,
    pytest_xdist_make_scheduler,
    xdist_scope,
)


def test_a_module_is_one_unit_whatever_its_tests_and_parameters() -> None:
    ids = ["tests/unit/test_a.py::test_x", "tests/unit/test_a.py::test_y[1-2]",
           "tests/unit/test_a.py::TestC::test_z"]  # fmt: skip
    assert {xdist_scope(i) for i in ids} == {"tests/unit/test_a.py"}
    assert xdist_scope("tests/unit/test_b.py::test_x") == "tests/unit/test_b.py"


def test_every_e2e_module_is_one_unit() -> None:
    ids = [f"{E2E}/local_serve/test_openai_e2e.py::test_a",
           f"{E2E}/local_serve/test_self_healing.py::test_b[TokenEngine]",
           f"{E2E}/test_mesh_scaling.py::test_x",
           f"{E2E}/test_multinode.py::test_y"]  # fmt: skip
    assert {xdist_scope(i) for i in ids} == {E2E}


def test_the_last_e2e_modules_are_units_of_their_own_after_every_other_test() -> None:
    assert {xdist_scope(f"{m}::test_x[1]") for m in E2E_LAST} == set(E2E_LAST)
    ids = [f"{E2E}/local_serve/test_openai_e2e.py::test_a", f"{E2E_LAST[1]}::test_b",
           f"{E2E}/test_multinode.py::test_c", f"{E2E_LAST[0]}::test_d",
           "tests/integration/test_e.py::test_f", f"{E2E_LAST[1]}::test_g",
           "tests/unit/test_h.py::test_i"]  # fmt: skip
    items = [SimpleNamespace(nodeid=i) for i in ids]
    pytest_collection_modifyitems(items)  # type: ignore[arg-type]
    assert [i.nodeid for i in items] == [ids[0], ids[2], ids[4], ids[6], ids[3], ids[1], ids[5]]


def test_a_look_alike_folder_and_odd_ids_are_their_own_units() -> None:
    assert xdist_scope("tests/e2e_other/test_a.py::t") == "tests/e2e_other/test_a.py"
    assert xdist_scope("tests/integration/test_a.py") == "tests/integration/test_a.py"  # no "::"
    assert xdist_scope("") == ""


class FakeWorker:
    """Stands in for xdist's WorkerController (no worker process): keeps what it is sent and
    runs it as a worker does, a test only once it knows the next one or is told to stop."""

    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.queue: list[int] = []
        self.shutting_down = False
        self.ran: list[str] = []

    def send_runtest_some(self, indices: list[int]) -> None:
        self.queue += indices

    def shutdown(self) -> None:
        self.shutting_down = True

    def can_run(self) -> bool:
        return len(self.queue) >= 2 or (len(self.queue) == 1 and self.shutting_down)


# A long e2e unit, eight short modules, then `E2E_LAST`'s two units.
COLLECTION = (
    [f"{E2E}/test_multinode.py::test_{i}" for i in range(4)]
    + [f"tests/unit/test_{m}.py::test_{i}" for m in "abcdefgh" for i in range(5)]
    + [f"{E2E_LAST[0]}::test_{i}" for i in range(2)]
    + [f"{E2E_LAST[1]}::test_{i}" for i in range(4)]
)


def duration(nodeid: str) -> float:
    """Simulated time: an `E2E_LAST` test takes 30, any other e2e test 10, the rest 1."""
    if nodeid.startswith(E2E_LAST):
        return 30.0
    return 10.0 if nodeid.startswith(E2E) else 1.0


def simulate(
    dies: Callable[[FakeWorker, str], bool] = lambda worker, nodeid: False,
) -> list[FakeWorker]:
    """`COLLECTION` on two workers under the project's scheduler, each test ending in time order,
    until no worker has a test it can run; `dies(worker, nodeid)`: the worker is killed as it
    starts that test (xdist then calls `remove_node`, as on a worker's crash)."""
    config = SimpleNamespace(option=SimpleNamespace(), getvalue=lambda name: ["2*popen"])
    scheduler = pytest_xdist_make_scheduler(config, None)  # type: ignore[arg-type]
    scheduler.log = lambda *args: None
    workers = [FakeWorker("gw0"), FakeWorker("gw1")]
    for worker in workers:
        scheduler.add_node(worker)
        scheduler.add_node_collection(worker, COLLECTION)
    scheduler.schedule()
    alive = list(workers)
    now, running = 0.0, {}  # worker -> (its test's index, when it ends)
    while True:
        for worker in list(alive):
            if worker not in running and worker.can_run():
                index = worker.queue.pop(0)
                if dies(worker, COLLECTION[index]):
                    alive.remove(worker)
                    scheduler.remove_node(worker)
                    continue
                running[worker] = (index, now + duration(COLLECTION[index]))
                worker.ran.append(COLLECTION[index])
        if not running:
            return workers
        worker = min(running, key=lambda w: running[w][1])
        index, now = running.pop(worker)
        scheduler.mark_test_complete(worker, index)


def test_the_last_units_go_one_to_each_worker() -> None:
    """Two workers, one on the long e2e unit, one on short modules, ending close together: each
    of `E2E_LAST`'s units goes to a different worker. (xdist's own rule gives a worker its next
    unit at two tests left: here the module worker took both, bench_served having two tests, and
    ran them one after the other while the e2e worker had finished.)"""
    workers = simulate()
    assert sorted(workers[0].ran + workers[1].ran) == sorted(COLLECTION)
    takers = [
        {i for i, w in enumerate(workers) for t in w.ran if t.startswith(m)} for m in E2E_LAST
    ]
    assert all(len(t) == 1 for t in takers) and takers[0] != takers[1], takers
    assert all(w.shutting_down for w in workers)


def test_a_worker_killed_in_a_last_unit_leaves_its_tests_to_the_other() -> None:
    """The worker that took an `E2E_LAST` unit dies as it starts its first test: the unit goes
    back to the queue and the other worker runs it, and every other test, to the end, and is
    told to stop. (xdist alone also queued the dead worker's finished modules again and sent
    one as no test at all: the survivor, one test left, then waited forever.)"""
    dead: list[FakeWorker] = []

    def dies(worker: FakeWorker, nodeid: str) -> bool:
        if not dead and nodeid.startswith(E2E_LAST):
            dead.append(worker)
        return worker in dead

    workers = simulate(dies)
    (survivor,) = [w for w in workers if w not in dead]
    assert survivor.shutting_down and not survivor.queue
    ran = dead[0].ran + survivor.ran
    assert sorted(ran) == sorted(COLLECTION) and len(set(ran)) == len(ran)
    assert not any(t.startswith(E2E_LAST) for t in dead[0].ran)
