"""Replica choice without central state.

Encoder for a chunk: rendezvous (highest-random-weight) hashing of the chunk key
over the live replicas, so every processor and LLM replica agrees without
talking, each replica's cache holds a disjoint shard, and losing a replica
moves only its shard.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash


def rendezvous(key: bytes, replicas: Sequence[str]) -> str:
    """The replica with the highest weight for ``key``."""
    if not replicas:
        raise ValueError("no replicas")
    return max(replicas, key=lambda r: xxhash.xxh3_64_intdigest(r.encode() + b"\0" + key))
