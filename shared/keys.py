"""Cache identities: xxh3_128 over binary, length-prefixed, domain-tagged fields.

Every field is framed as an 8-byte little-endian length followed by its bytes,
so distinct field lists can never frame to the same byte string. Never JSON,
never pickle, never Python's ``hash()``.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import NewType

import xxhash

MediaKey = NewType("MediaKey", bytes)
ChunkKey = NewType("ChunkKey", bytes)
Fingerprint = NewType("Fingerprint", bytes)
BlockHash = NewType("BlockHash", bytes)  # a KV block's chained hash (shared.block_hash)

_LEN = struct.Struct("<Q")
_Bytes = bytes | bytearray | memoryview


def _update(h: xxhash.xxh3_128, data: _Bytes) -> None:
    h.update(_LEN.pack(memoryview(data).nbytes))
    h.update(data)


def hash_fields(tag: bytes, *fields: _Bytes) -> bytes:
    """xxh3_128 digest (16 bytes) of a domain tag and length-prefixed fields."""
    h = xxhash.xxh3_128()
    _update(h, tag)
    for f in fields:
        _update(h, f)
    return h.digest()


def salt_bytes(salt: str | None) -> bytes:
    """``None`` (shared namespace) and ``""`` must differ, hence the presence byte."""
    return b"\x00" if salt is None else b"\x01" + salt.encode()


def fingerprint(tag: str, settings: Iterable[tuple[str, object]]) -> Fingerprint:
    """Identity of a configuration: sorted (name, repr(value)) pairs, each framed."""
    fields: list[bytes] = []
    for name, value in sorted(settings):
        fields += [name.encode(), repr(value).encode()]
    return Fingerprint(hash_fields(b"fingerprint:" + tag.encode(), *fields))


def media_key(salt: str | None, modality: str, data: _Bytes, processor_fp: Fingerprint) -> MediaKey:
    """Identity of one media file's raw bytes under one salt and preprocessing."""
    return MediaKey(hash_fields(b"media", salt_bytes(salt), modality.encode(), data, processor_fp))


def uuid_media_key(salt: str | None, modality: str, uuid: str, processor_fp: Fingerprint) -> MediaKey:
    """Identity of a client-named media item (vLLM's ``uuid``), standing for its bytes."""
    return MediaKey(
        hash_fields(b"media-uuid", salt_bytes(salt), modality.encode(), uuid.encode(), processor_fp)
    )


def data_url_alias(
    salt: str | None, modality: str, url: str | _Bytes, processor_fp: Fingerprint
) -> bytes | None:
    """A name for a ``data:`` URL's text (or its raw UTF-8 bytes: the same name), so a repeat is
    found without base64-decoding it again.

    Only an alias: the processor maps it to the :func:`media_key` of the decoded bytes.
    """
    text = url.encode() if isinstance(url, str) else url
    if bytes(text[:5]).lower() != b"data:":
        return None
    return hash_fields(b"data-url", salt_bytes(salt), modality.encode(), text, processor_fp)


def file_alias(
    salt: str | None, modality: str, path: str, signature: tuple[int, ...], processor_fp: Fingerprint
) -> bytes:
    """A name for a local file's current contents, from its path and stat signature (see
    :meth:`processor.media_source.MediaSource.file_signature`), so a repeat is found unread.

    Only an alias: the processor maps it to the :func:`media_key` of the bytes it read.
    """
    status = ",".join(map(str, signature)).encode()  # any int (inode numbers may exceed int64)
    return hash_fields(b"file", salt_bytes(salt), modality.encode(), path.encode(), status, processor_fp)


def chunk_key(salt: str | None, pixels: _Bytes, shape: Iterable[int], processor_fp: Fingerprint) -> ChunkKey:
    """Identity of one encoder chunk from its decoded uint8 pixels (and their shape)."""
    dims = tuple(shape)
    dims_bytes = struct.pack(f"<{len(dims)}I", *dims)
    return ChunkKey(hash_fields(b"chunk", salt_bytes(salt), dims_bytes, pixels, processor_fp))


def embed_key(chunk: ChunkKey, vision_fp: Fingerprint) -> bytes:
    """What the encoder cache stores: a chunk under one set of vision weights."""
    return hash_fields(b"embed", chunk, vision_fp)
