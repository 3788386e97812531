"""`Topology`: a launched mesh's shape is refused at once when it cannot be started, before any
process is forked."""

from __future__ import annotations

import pytest

from services.launch.local_mesh import Topology


@pytest.mark.parametrize(
    "fields, error",
    [
        ({"num_token": 0}, "at least one prompt and one token engine"),
        ({"num_token": 2, "num_shards": 3}, "multiple of num_token"),
        ({"token_engine_threads": -1}, "token_engine_threads must be >= 0"),
        ({"decode_lanes": 0}, "decode_lanes must be at least 1"),
        ({"model_peers": 1}, "model_peers rotate decode lanes"),
    ],
)
def test_a_topology_that_cannot_start_is_refused(fields: dict, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        Topology("unused", **fields)
