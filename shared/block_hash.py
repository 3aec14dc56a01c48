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
import torch
import xxhash

from shared.keys import Fingerprint, hash_fields, salt_bytes
from shared.messages import MediaSpan

BlockHash = NewType("BlockHash", bytes)

_EXTRA = struct.Struct("<16sq")  # chunk key, block start - chunk start
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
    token_ids: Sequence[int] | np.ndarray | torch.Tensor,
    spans: Sequence[MediaSpan],
    block_size: int,
    root: BlockHash,
    known: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Hashes of all full blocks of ``token_ids``; ``known`` is a prefix already computed.

    NOTE: pass a tensor or an array when you have one: turning a Python list into bytes
    costs more than hashing them.
    """
    num_blocks = len(token_ids) // block_size
    hashes = list(known[:num_blocks])
    if len(hashes) == num_blocks:
        return hashes
    first = len(hashes)
    tokens = _int32_bytes(token_ids[first * block_size : num_blocks * block_size])
    width = 4 * block_size
    prev = hashes[-1] if hashes else root
    extras = _block_extras(_chunk_intervals(spans), block_size, first, num_blocks) if spans else {}
    # Runs of text-only blocks take the fast path: one concatenation and one digest per block.
    i = first
    for stop in [*sorted(extras), num_blocks]:
        for offset in range((i - first) * width, (stop - first) * width, width):
            prev = _digest(prev + tokens[offset : offset + width])
            hashes.append(prev)
        if stop < num_blocks:
            offset = (stop - first) * width
            prev = _digest(prev + tokens[offset : offset + width] + extras[stop])
            hashes.append(prev)
        i = stop + 1
    return hashes


def _block_extras(
    chunks: list[tuple[int, int, bytes]], block_size: int, first: int, stop: int
) -> dict[int, bytes]:
    """Block index → (chunk key, block start - chunk start) of every chunk overlapping it, in order."""
    extras: dict[int, bytes] = {}
    pack = _EXTRA.pack
    for start, end, key in chunks:
        for i in range(max(first, start // block_size), min(stop, -(-end // block_size))):
            piece = pack(key, i * block_size - start)
            extras[i] = extras[i] + piece if i in extras else piece
    return extras


def _int32_bytes(tokens: Sequence[int] | np.ndarray | torch.Tensor) -> bytes:
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.numpy()
    return np.asarray(tokens, dtype="<i4").tobytes()
