"""The hash chain that names a full KV block by its tokens and everything before them (pure).

Block i's hash is H(hash of block i-1, block i's token ids); block 0's parent is the namespace's
seed (the model), so equal hashes mean equal prefixes of the same model. blake2b rather than
Python's `hash`: the value must be the same in every process (engines publish hashes and the
router compares them), and `hash` of a str changes per process. 64 bits: a collision among the
few million blocks a fleet holds is ~1e-7 likely; vLLM's default makes the same trade.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = int


def namespace_seed(namespace: str) -> BlockHash:
    """The parent hash of every chain's first block, for one model (or tenant)."""
    return int.from_bytes(hashlib.blake2b(namespace.encode(), digest_size=8).digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, seed: BlockHash) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids`, in order (a trailing partial block has none)."""
    hashes: list[BlockHash] = []
    parent = seed
    for begin in range(0, len(token_ids) - block_size + 1, block_size):
        block = array("q", token_ids[begin : begin + block_size])
        data = parent.to_bytes(8, "little") + block.tobytes()
        parent = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
        hashes.append(parent)
    return hashes
