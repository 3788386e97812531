"""What a mesh service does: one name for it everywhere.

Splitwise's machine pools (prompt, token, mixed) are the engines' roles; an attention shard
(Lamina) is the fourth. Deployment names, registry entries, worker configs, load reports and the
cluster policy's pools all use this enum; it encodes as its string value on the wire.
"""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    PROMPT = "prompt"  # prefill (Splitwise's prompt machine)
    TOKEN = "token"  # decode (Splitwise's token machine), with or without a shard group
    MIXED = "mixed"  # both (Splitwise's mixed pool; the in-process engine)
    SHARD = "shard"  # an attention shard: KV and decode attention for a range of KV heads
    # A replica of the model's weights running a token engine's decode lanes' layer slices
    # (Lamina 4.3's rotation; services/engine/model_peer.py). On Ray it registers and a token
    # engine claims it (services/mesh/peer_group.py); the local launcher links it directly.
    MODEL_PEER = "model_peer"

    @property
    def is_engine(self) -> bool:
        return self not in (Role.SHARD, Role.MODEL_PEER)
