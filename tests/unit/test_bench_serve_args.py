"""`bench/serve.py --mesh-args`: a setting of deploy/local.yaml's `mesh:` changed for one run, and
refused at once (not after minutes of benching and a server that never comes up) when wrong."""

from __future__ import annotations

import pytest

from bench import serve


def parse(monkeypatch: pytest.MonkeyPatch, *argv: str) -> dict:
    monkeypatch.setattr("sys.argv", ["serve.py", *argv])
    return serve.parse_args().mesh_args


def test_mesh_args_change_the_files_and_keep_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse(monkeypatch) == {}
    change = parse(monkeypatch, "--mesh-args", '{"token_engine_threads": 1}')
    assert change == {"token_engine_threads": 1}
    merged = serve.yaml_mesh_args() | change
    assert merged["token_engine_threads"] == 1 and merged["shards_per_group"] == 2


@pytest.mark.parametrize(
    "value, error",
    [
        ('{"token_engine_threads": 0}', "greater than or equal to 1"),
        ('{"no_such_switch": 1}', "no_such_switch"),
        ("[1]", "a JSON object of mesh args"),
        ('{"decode_lanes": "many"}', "decode_lanes"),
        ("{not json", "invalid loads value"),
    ],
)
def test_wrong_mesh_args_are_refused_before_anything_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], value: str, error: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse(monkeypatch, "--mesh-args", value)
    assert exit_info.value.code == 2
    assert error in capsys.readouterr().err
