"""`make test`'s two workers each take whole units (tests/conftest.py): a module, or every e2e
module together (each starts a Ray cluster: one at a time) but the few that go out last, each
a unit of its own."""

from __future__ import annotations

from types import SimpleNamespace

from tests.conftest import E2E, E2E_LAST, pytest_collection_modifyitems, xdist_scope


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
