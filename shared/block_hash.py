"""Chained block hashes for the KV prefix cache, aware of media identity.

``h_i = xxh3_128(h_{i-1} || tokens_i as int32 LE || extra_i)`` over full blocks only,
with ``h_{-1} = H("kv", model fingerprint, salt)``. ``extra_i`` lists, for every
media chunk overlapping block ``i``, the chunk key (16 bytes) and the offset of
the block start relative to the chunk start (int64 LE). All fields are fixed
width, so the framing is unambiguous.

Cost: numpy cuts the token bytes into one ``bytes`` object per block in one call,
and builds every media block's payload (tokens, key, offset) in a handful of
vectorized calls; Python then does one concatenation and one digest per block. A
text-only prompt costs only that last step: the fast path.

The processor (routing, probing) and the LLM stage use this one implementation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np
import torch
import xxhash

from mmcache.shared.keys import BlockHash, Fingerprint, hash_fields, salt_bytes
from mmcache.shared.media_spans import chunk_places
from mmcache.shared.messages import MediaSpan

KEY_BYTES = 16


def root_hash(model_fp: Fingerprint, salt: str | None) -> BlockHash:
    return BlockHash(hash_fields(b"kv", model_fp, salt_bytes(salt)))


def block_hashes(
    token_ids: Sequence[int] | np.ndarray | torch.Tensor,
    spans: Sequence[MediaSpan],
    block_size: int,
    root: BlockHash,
    known: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Hashes of all full blocks of ``token_ids``; ``known`` is a prefix already computed.

    NOTE: pass a tensor or an array when you have one: turning a Python list into int32
    costs more than hashing it.
    """
    num_blocks = len(token_ids) // block_size
    hashes = list(known[:num_blocks])
    first = len(hashes)
    if first == num_blocks:
        return hashes
    blocks = _int32(token_ids[first * block_size : num_blocks * block_size]).view(f"V{4 * block_size}")
    payloads = blocks.tolist()  # one bytes object per block
    if spans:
        _add_media(payloads, blocks, spans, first * block_size)
    prev: bytes = hashes[-1] if hashes else root
    digest = xxhash.xxh3_128_digest
    # NOTE: one cast for the list, not a BlockHash() call per block (the hot loop)
    hashes += cast(list[BlockHash], [prev := digest(prev + payload) for payload in payloads])
    return hashes


def _add_media(payloads: list[bytes], blocks: np.ndarray, spans: Sequence[MediaSpan], base: int) -> None:
    """Append to every block's payload, for each chunk overlapping it in prompt order,
    (chunk key, block start - chunk start). ``payloads[0]`` starts at token ``base``."""
    block_size = blocks.dtype.itemsize // 4
    count = len(payloads)
    runs: list[tuple[int, int]] = []  # per chunk: its block range
    parts: list[np.ndarray] = []  # ... and those blocks' tokens
    offsets: list[int] = []  # per (chunk, block) pair: block start - chunk start
    keys: list[bytes] = []  # ... and the chunk's key
    for chunk in chunk_places(spans):
        start, end = chunk.start - base, chunk.end - base
        lo = start // block_size if start > 0 else 0
        hi = min(-(-end // block_size), count)
        if hi > lo:
            runs.append((lo, hi))
            parts.append(blocks[lo:hi])
            offsets += range(lo * block_size - start, hi * block_size - start, block_size)
            keys += [chunk.key] * (hi - lo)
    if not runs:
        return
    records = np.empty(
        len(offsets), dtype=[("tokens", blocks.dtype), ("key", f"V{KEY_BYTES}"), ("offset", "<i8")]
    )
    records["tokens"] = np.concatenate(parts)
    records["key"] = np.frombuffer(b"".join(keys), dtype=f"V{KEY_BYTES}")
    records["offset"] = offsets
    media = records.view(f"V{records.dtype.itemsize}").tolist()  # tokens + key + offset, per pair
    width = blocks.dtype.itemsize
    i, last = 0, -1
    for lo, hi in runs:
        if lo == last:  # this chunk starts inside the block the previous chunk ended in
            payloads[lo] += media[i][width:]
            lo += 1
            i += 1
        payloads[lo:hi] = media[i : i + hi - lo]
        i += hi - lo
        last = hi - 1


def _int32(tokens: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.numpy()
    return np.ascontiguousarray(tokens, dtype="<i4")
