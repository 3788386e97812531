"""`make test`'s two workers each take whole units (tests/conftest.py): a module, or every e2e
module together (each starts a Ray cluster: one at a time)."""

from __future__ import annotations

from tests.conftest import E2E, xdist_scope


def test_a_module_is_one_unit_whatever_its_tests_and_parameters() -> None:
    ids = ["tests/unit/test_a.py::test_x", "tests/unit/test_a.py::test_y[1-2]",
           "tests/unit/test_a.py::TestC::test_z"]  # fmt: skip
    assert {xdist_scope(i) for i in ids} == {"tests/unit/test_a.py"}
    assert xdist_scope("tests/unit/test_b.py::test_x") == "tests/unit/test_b.py"


def test_every_e2e_module_is_one_unit() -> None:
    ids = [f"{E2E}/local_serve/test_openai_e2e.py::test_a",
           f"{E2E}/local_serve/test_self_healing.py::test_b[TokenEngine]",
           f"{E2E}/test_api_fuzz.py::test_fuzzed",
           f"{E2E}/test_mesh_scaling.py::test_x"]  # fmt: skip
    assert {xdist_scope(i) for i in ids} == {E2E}


def test_a_look_alike_folder_and_odd_ids_are_their_own_units() -> None:
    assert xdist_scope("tests/e2e_other/test_a.py::t") == "tests/e2e_other/test_a.py"
    assert xdist_scope("tests/integration/test_a.py") == "tests/integration/test_a.py"  # no "::"
    assert xdist_scope("") == ""
