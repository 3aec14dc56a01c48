"""Replica choice without central state.

Encoder for a chunk: rendezvous (highest-random-weight) hashing of the chunk key
over the live replicas, so every processor and LLM replica agrees without
talking, each replica's cache holds a disjoint shard, and losing a replica
moves only its shard.

LLM replica for a request: the longest cached prefix, then the lightest load; ties go by
rendezvous weight of the prompt's first block, so conversations that begin alike meet on one
replica (where their prefix will be) and different ones spread.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash


def weight(replica: str, key: bytes) -> int:
    """Rendezvous weight of ``replica`` for ``key``."""
    return xxhash.xxh3_64_intdigest(replica.encode() + b"\0" + key)


def rendezvous(key: bytes, replicas: Sequence[str]) -> str:
    """The replica with the highest weight for ``key``."""
    if not replicas:
        raise ValueError("no replicas")
    return max(replicas, key=lambda r: weight(r, key))
