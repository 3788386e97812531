"""`make test`'s two workers each take whole units (tests/conftest.py): a module, or every e2e
module together (each starts a Ray cluster: one at a time) but the few that go out last, each
a unit of its own."""

from __future__ import annotations

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


def test_the_last_units_go_one_to_each_worker() -> None:
    """Two workers, one on the long e2e unit, one on short modules, ending close together: each
    of `E2E_LAST`'s units goes to a different worker. (xdist's own rule gives a worker its next
    unit at two tests left: here the module worker took both, bench_served having two tests, and
    ran them one after the other while the e2e worker had finished.) Time is simulated: an e2e
    test takes 10, an `E2E_LAST` one 30, any other 1."""
    collection = [f"{E2E}/test_multinode.py::test_{i}" for i in range(4)]
    collection += [f"tests/unit/test_{m}.py::test_{i}" for m in "abcdefgh" for i in range(5)]
    collection += [f"{E2E_LAST[0]}::test_{i}" for i in range(2)]
    collection += [f"{E2E_LAST[1]}::test_{i}" for i in range(4)]

    def duration(nodeid: str) -> float:
        if nodeid.startswith(E2E_LAST):
            return 30.0
        return 10.0 if nodeid.startswith(E2E) else 1.0

    config = SimpleNamespace(option=SimpleNamespace(), getvalue=lambda name: ["2*popen"])
    scheduler = pytest_xdist_make_scheduler(config, None)  # type: ignore[arg-type]
    scheduler.log = lambda *args: None
    workers = [FakeWorker("gw0"), FakeWorker("gw1")]
    for worker in workers:
        scheduler.add_node(worker)
        scheduler.add_node_collection(worker, collection)
    scheduler.schedule()
    now, running = 0.0, {}  # worker -> (its test's index, when it ends)
    while True:
        for worker in workers:
            if worker not in running and worker.can_run():
                index = worker.queue.pop(0)
                running[worker] = (index, now + duration(collection[index]))
                worker.ran.append(collection[index])
        if not running:
            break
        worker = min(running, key=lambda w: running[w][1])
        index, now = running.pop(worker)
        scheduler.mark_test_complete(worker, index)
    assert sorted(workers[0].ran + workers[1].ran) == sorted(collection)
    takers = [
        {i for i, w in enumerate(workers) for t in w.ran if t.startswith(m)} for m in E2E_LAST
    ]
    assert all(len(t) == 1 for t in takers) and takers[0] != takers[1], takers
