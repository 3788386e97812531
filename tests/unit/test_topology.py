"""`Topology`: a launched mesh's shape is refused at once when it cannot be started, before any
process is forked."""

from __future__ import annotations

import pytest

from common.mesh_options import MeshOptions
from services.launch.local_mesh import Topology


@pytest.mark.parametrize(
    "fields, options, error",
    [
        ({"num_token": 0}, {}, "at least one prompt and one token engine"),
        ({"num_token": 2, "num_shards": 3}, {}, "multiple of num_token"),
        # Bounds a Struct built in Python skips: the topology checks them as the YAML edge does.
        ({}, {"token_engine_threads": -1}, r">= 1 - at `\$.token_engine_threads`"),
        ({"num_shards": 2}, {"decode_lanes": 0}, r"decode_lanes"),
        # Shards per group come from the counts: none here, so no model peers.
        ({}, {"model_peers": 1}, "model_peers rotate decode lanes"),
    ],
)
def test_a_topology_that_cannot_start_is_refused(fields: dict, options: dict, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        Topology("unused", **fields, options=MeshOptions(**options))


def test_shard_groups_come_from_the_counts() -> None:
    """`options.shards_per_group` is the topology's num_shards / num_token, whatever was given."""
    given = MeshOptions(shards_per_group=7)
    topology = Topology("unused", num_token=2, num_shards=4, options=given)
    assert topology.options.shards_per_group == topology.shards_per_group == 2
    assert Topology("unused").options.shards_per_group == 0  # local attention
    with_peers = Topology("unused", num_shards=2, options=MeshOptions(model_peers=1))
    assert with_peers.options.model_peers == 1
