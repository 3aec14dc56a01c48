"""Chained block hashes for the KV prefix cache, aware of media identity.

``h_i = xxh3_128(h_{i-1} || tokens_i as int32 LE || extra_i)`` over full blocks only,
with ``h_{-1} = H("kv", model fingerprint, salt)``. ``extra_i`` lists, for every
media chunk overlapping block ``i``, the chunk key (16 bytes) and the offset of
the block start relative to the chunk start (int64 LE). All fields are fixed
width, so the framing is unambiguous. A text-only block is one digest call over
32 + 4·B bytes: the fast path.

The processor (routing, probing) and the LLM stage use this one implementation.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NewType

import numpy as np
import xxhash

from shared.keys import Fingerprint, hash_fields, salt_bytes
from shared.messages import MediaSpan

BlockHash = NewType("BlockHash", bytes)

_OFFSET = struct.Struct("<q")
_digest = xxhash.xxh3_128_digest


def root_hash(model_fp: Fingerprint, salt: str | None) -> BlockHash:
    return BlockHash(hash_fields(b"kv", model_fp, salt_bytes(salt)))


def _chunk_intervals(spans: Sequence[MediaSpan]) -> list[tuple[int, int, bytes]]:
    """(start, end, chunk_key) of every chunk, in prompt order."""
    out = []
    for span in sorted(spans, key=lambda s: s.offset):
        n = span.tokens_per_chunk
        for i, key in enumerate(span.chunk_keys):
            start = span.offset + i * n
            out.append((start, start + n, key))
    return out


def block_hashes(
    token_ids: Sequence[int] | np.ndarray,
    spans: Sequence[MediaSpan],
    block_size: int,
    root: BlockHash,
    known: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Hashes of all full blocks of ``token_ids``; ``known`` is a prefix already computed."""
    num_blocks = len(token_ids) // block_size
    hashes = list(known[:num_blocks])
    if len(hashes) == num_blocks:
        return hashes
    first = len(hashes)
    tokens = np.asarray(token_ids[first * block_size : num_blocks * block_size], dtype="<i4").tobytes()
    width = 4 * block_size
    chunks = _chunk_intervals(spans) if spans else []
    lo = 0  # first chunk that can still overlap
    prev = hashes[-1] if hashes else root
    for i in range(first, num_blocks):
        begin, end = i * block_size, (i + 1) * block_size
        body = tokens[(i - first) * width : (i - first + 1) * width]
        while lo < len(chunks) and chunks[lo][1] <= begin:
            lo += 1
        extra = b""
        j = lo
        while j < len(chunks) and chunks[j][0] < end:
            start, _, key = chunks[j]
            extra += key + _OFFSET.pack(begin - start)
            j += 1
        prev = BlockHash(_digest(prev + body + extra))
        hashes.append(prev)
    return hashes
