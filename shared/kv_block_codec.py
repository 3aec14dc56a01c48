"""Keys and values of the shared KV tier: one stored value per full KV block.

Key: ``mmkv1:`` + hex(layout digest) + ``:`` + hex(block hash). The block hash is the salted,
media-aware chain hash (:mod:`shared.block_hash`, its root covers the weights and the salt); the
layout digest covers the model fingerprint and how the KV is laid out (dtype, block size, layers,
kv heads, head dim, prompt logprob width), so two models or two layouts sharing one store never
read each other's blocks.

Value: a fixed header, then the payload::

    magic "MMKV" | version u16 | flags u16 | layout digest 16 B | block hash 16 B
    | payload bytes u64 | xxh3_128(payload) 16 B
    payload = block tokens (int32 LE, block_size) | K/V bytes (layers, block_size, 2 * kv_heads,
              head_dim) | [prompt logprob ids int32, values float32: (block_size, width) each]

:func:`decode` checks every header field against what the reader expects and the payload's exact
length and checksum before anything is used; a value that fails any check is refused
(:class:`BadValue`, with the reason), never used.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
import xxhash

from mmcache.shared.keys import BlockHash, Fingerprint, hash_fields

MAGIC = b"MMKV"
VERSION = 1
FLAG_LOGPROBS = 1
_HEADER = struct.Struct("<4sHH16s16sQ16s")
HEADER_BYTES = _HEADER.size


class BadValue(ValueError):
    """A stored value that must not be used; ``reason`` names the failed check (a metric label)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class KVLayout:
    """What a stored block's bytes mean; blocks are shared only between equal layouts."""

    model: Fingerprint
    dtype: torch.dtype
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    logprob_width: int  # columns of a prompt logprob entry (1 + K_MAX)

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        return (self.num_layers, self.block_size, 2 * self.num_kv_heads, self.head_dim)

    @cached_property
    def kv_bytes(self) -> int:
        n = self.num_layers * self.block_size * 2 * self.num_kv_heads * self.head_dim
        return n * torch.empty((), dtype=self.dtype).element_size()

    @property
    def logprob_bytes(self) -> int:
        return 2 * 4 * self.block_size * self.logprob_width

    # NOTE: cached (no slots, so the instance has a __dict__ to keep it in): every key and every
    # value written carries it, and hashing the fields again cost ~5 us a block.
    @cached_property
    def digest(self) -> bytes:
        fields = (self.block_size, self.num_layers, self.num_kv_heads, self.head_dim, self.logprob_width)
        return hash_fields(
            b"kv-layout", self.model, str(self.dtype).encode(), *(struct.pack("<q", f) for f in fields)
        )

    @cached_property
    def _key_prefix(self) -> str:
        return f"mmkv1:{self.digest.hex()}:"

    def key(self, block_hash: BlockHash) -> str:
        return self._key_prefix + block_hash.hex()


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """One block as read from (or written to) the store, on the CPU."""

    block_hash: BlockHash
    token_ids: tuple[int, ...]
    kv: torch.Tensor  # layout.kv_shape, layout.dtype
    logprob_ids: torch.Tensor | None = None  # (block_size, width) int32, or None
    logprob_values: torch.Tensor | None = None  # (block_size, width) float32


def encode(layout: KVLayout, block: StoredBlock) -> bytes:
    # NOTE: the parts stay views of the tensors' memory until the one join that makes the value:
    # hashed part by part, copied once.
    arrays = [np.asarray(block.token_ids, dtype="<i4"), block.kv.contiguous().view(torch.uint8).numpy()]
    flags = 0
    if block.logprob_ids is not None and block.logprob_values is not None:
        flags |= FLAG_LOGPROBS
        arrays.append(block.logprob_ids.to(torch.int32).contiguous().numpy())
        arrays.append(block.logprob_values.to(torch.float32).contiguous().numpy())
    parts = [a.data.cast("B") for a in arrays]
    hasher = xxhash.xxh3_128()
    for part in parts:
        hasher.update(part)
    length = sum(part.nbytes for part in parts)
    header = _HEADER.pack(MAGIC, VERSION, flags, layout.digest, block.block_hash, length, hasher.digest())
    return b"".join([header, *parts])


def decode(layout: KVLayout, block_hash: BlockHash, value: bytes) -> StoredBlock:
    """The block ``value`` holds, if it is exactly what ``layout`` and ``block_hash`` expect."""
    if len(value) < HEADER_BYTES:
        raise BadValue("truncated")
    magic, version, flags, digest, stored_hash, length, checksum = _HEADER.unpack_from(value)
    if magic != MAGIC or version != VERSION:
        raise BadValue("format")
    if digest != layout.digest:
        raise BadValue("layout")
    if stored_hash != block_hash:
        raise BadValue("hash")
    token_bytes = 4 * layout.block_size
    expected = token_bytes + layout.kv_bytes + (layout.logprob_bytes if flags & FLAG_LOGPROBS else 0)
    if length != expected or len(value) != HEADER_BYTES + expected:
        raise BadValue("truncated" if len(value) < HEADER_BYTES + expected else "length")
    payload = memoryview(value)[HEADER_BYTES:]
    if xxhash.xxh3_128_digest(payload) != checksum:
        raise BadValue("checksum")
    # NOTE: bytearray copies: the tensors must own writable memory, not alias the reply buffer.
    tokens = tuple(np.frombuffer(payload[:token_bytes], dtype="<i4").tolist())
    kv_end = token_bytes + layout.kv_bytes
    raw = torch.frombuffer(bytearray(payload[token_bytes:kv_end]), dtype=torch.uint8)
    kv = raw.view(layout.dtype).view(layout.kv_shape)
    ids = values = None
    if flags & FLAG_LOGPROBS:
        shape = (layout.block_size, layout.logprob_width)
        half = kv_end + layout.logprob_bytes // 2
        ids = torch.frombuffer(bytearray(payload[kv_end:half]), dtype=torch.int32).view(shape)
        values = torch.frombuffer(bytearray(payload[half:]), dtype=torch.float32).view(shape)
    return StoredBlock(block_hash, tokens, kv, ids, values)
