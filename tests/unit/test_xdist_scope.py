"""`make test`'s two workers each take whole units (tests/conftest.py): a module, or every module
of tests/e2e/local_serve together (one package server, killed last in its conftest's order)."""

from __future__ import annotations

from tests.conftest import LOCAL_SERVE, xdist_scope


def test_a_module_is_one_unit_whatever_its_tests_and_parameters() -> None:
    ids = ["tests/unit/test_a.py::test_x", "tests/unit/test_a.py::test_y[1-2]",
           "tests/unit/test_a.py::TestC::test_z"]  # fmt: skip
    assert {xdist_scope(i) for i in ids} == {"tests/unit/test_a.py"}
    assert xdist_scope("tests/unit/test_b.py::test_x") == "tests/unit/test_b.py"


def test_every_local_serve_module_is_one_unit() -> None:
    ids = [f"{LOCAL_SERVE}/test_openai_e2e.py::test_a",
           f"{LOCAL_SERVE}/test_self_healing.py::test_b[TokenEngine]",
           f"{LOCAL_SERVE}/test_loadgen_replay.py::test_server_killed_mid_replay"]  # fmt: skip
    assert {xdist_scope(i) for i in ids} == {LOCAL_SERVE}


def test_a_look_alike_folder_and_odd_ids_are_their_own_units() -> None:
    assert xdist_scope("tests/e2e/local_serve_other/test_a.py::t") == (
        "tests/e2e/local_serve_other/test_a.py"
    )
    assert xdist_scope("tests/e2e/test_api_fuzz.py") == "tests/e2e/test_api_fuzz.py"  # no "::"
    assert xdist_scope("") == ""
