"""What a `LocalMesh` (local_mesh.py) starts: how many of each service, where they run, and the
mesh's options every worker receives."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from common.mesh_options import MeshOptions, mesh_options


@dataclass(frozen=True)
class Topology:
    """How many of each service, and the options they run with.

    `options.shards_per_group` is set here, from the counts (num_shards / num_token); every other
    option is the caller's, checked as the serve config's are (`mesh_options`)."""

    model_path: str
    num_prompt: int = 1
    num_token: int = 1
    num_shards: int = 0  # in all; each token engine gets num_shards / num_token of them
    # Pin each token engine and its shards to cores (core_pinning.py); prompt engines float.
    pin_decode_groups: bool = True
    # PHASEMESH_OTEL_EXPORTER for every service ("" keeps this process's environment);
    # `{service_id}` is replaced, so `jsonl:/tmp/t/{service_id}.jsonl` gives each its own file.
    otel_exporter: str = ""
    options: MeshOptions = field(default_factory=MeshOptions)

    def __post_init__(self) -> None:
        if self.num_prompt < 1 or self.num_token < 1:
            raise ValueError("a topology needs at least one prompt and one token engine")
        if self.num_shards % self.num_token:
            raise ValueError("num_shards must be a multiple of num_token (equal shard groups)")
        per_group = self.num_shards // self.num_token
        options = msgspec.structs.replace(self.options, shards_per_group=per_group)
        # NOTE: a Struct built in Python skips its fields' bounds; converting checks them too.
        object.__setattr__(self, "options", mesh_options(msgspec.to_builtins(options)))

    @property
    def shards_per_group(self) -> int:
        return self.options.shards_per_group


__all__ = ["Topology"]
