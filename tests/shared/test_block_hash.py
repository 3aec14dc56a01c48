"""Block hashes: chained, binary, and aware of which media chunk (and where in it) a block covers."""

from __future__ import annotations

import struct

import xxhash

from mmcache.shared.block_hash import block_hashes, root_hash
from mmcache.shared.keys import Fingerprint
from mmcache.shared.messages import MediaSpan

B = 16
FP = Fingerprint(b"\x01" * 16)
ROOT = root_hash(FP, None)
IMG = 99  # placeholder token id


def image_span(offset: int, key: bytes, tokens: int = 48) -> MediaSpan:
    # grid (1, 2, 2*tokens/2) → tokens_per_chunk = 1 * (2 * tokens) / 4 ... keep it simple: h=2, w=2*tokens
    return MediaSpan(offset=offset, modality="image", grid_thw=(1, 2, 2 * tokens), chunk_keys=[key])


def prompt_with_image(prefix: int, tokens: int = 48, total: int = 96) -> list[int]:
    ids = list(range(1000, 1000 + prefix)) + [IMG] * tokens
    return ids + list(range(2000, 2000 + total - len(ids)))


def test_text_blocks_hash_exactly_as_documented():
    ids = list(range(40))
    hashes = block_hashes(ids, [], B, ROOT)
    assert len(hashes) == 2  # full blocks only: 40 // 16
    prev = ROOT
    for i, h in enumerate(hashes):
        body = struct.pack(f"<{B}i", *ids[i * B : (i + 1) * B])
        prev = xxhash.xxh3_128_digest(prev + body)
        assert h == prev


def test_chain_depends_on_every_earlier_block():
    a = list(range(64))
    b = list(a)
    b[3] = 7777
    ha, hb = block_hashes(a, [], B, ROOT), block_hashes(b, [], B, ROOT)
    assert all(x != y for x, y in zip(ha, hb, strict=True))


def test_incremental_matches_full():
    ids = list(range(100))
    full = block_hashes(ids, [], B, ROOT)
    part = block_hashes(ids[:50], [], B, ROOT)
    assert block_hashes(ids, [], B, ROOT, known=part) == full


def test_two_images_with_same_placeholders_never_share_a_block():
    ids = prompt_with_image(prefix=20)
    h1 = block_hashes(ids, [image_span(20, b"A" * 16)], B, ROOT)
    h2 = block_hashes(ids, [image_span(20, b"B" * 16)], B, ROOT)
    assert h1[0] == h2[0]  # block 0 is pure text (tokens 0..15), before the image
    assert all(x != y for x, y in zip(h1[1:], h2[1:], strict=True))


def test_same_image_at_another_offset_does_not_share_blocks():
    """The same image one token later: every block covering it sees another (key, offset)."""
    key = b"K" * 16
    ids = [IMG] * 64 + list(range(32))
    shifted = [7] + [IMG] * 64 + list(range(31))
    h1 = block_hashes(ids, [MediaSpan(0, "image", (1, 2, 128), [key])], B, ROOT)
    h2 = block_hashes(shifted, [MediaSpan(1, "image", (1, 2, 128), [key])], B, ROOT)
    assert len(h1) == len(h2) == 6
    assert not set(h1) & set(h2)


def test_offset_inside_the_image_is_part_of_the_hash():
    """Blocks made only of placeholder tokens of one image differ by their offset in it."""
    key = b"K" * 16
    ids = [IMG] * 64
    hashes = block_hashes(ids, [MediaSpan(0, "image", (1, 2, 128), [key])], B, ROOT)
    prev = ROOT
    for i, h in enumerate(hashes):
        body = struct.pack(f"<{B}i", *ids[i * B : (i + 1) * B])
        prev = xxhash.xxh3_128_digest(prev + body + key + struct.pack("<q", i * B))
        assert h == prev


def test_salt_separates_everything():
    ids = prompt_with_image(prefix=20)
    spans = [image_span(20, b"A" * 16)]
    plain = block_hashes(ids, spans, B, root_hash(FP, None))
    empty = block_hashes(ids, spans, B, root_hash(FP, ""))
    salted = block_hashes(ids, spans, B, root_hash(FP, "tenant-a"))
    assert not set(plain) & set(salted)
    assert not set(plain) & set(empty)
    assert not set(empty) & set(salted)


def test_model_fingerprint_separates_everything():
    ids = list(range(64))
    other = root_hash(Fingerprint(b"\x02" * 16), None)
    assert not set(block_hashes(ids, [], B, ROOT)) & set(block_hashes(ids, [], B, other))


def test_video_chunks_give_offsets_per_chunk():
    """A growing video: the blocks over its shared first chunks hash alike, later ones differ."""
    k1, k2, k3 = b"1" * 16, b"2" * 16, b"3" * 16
    short = MediaSpan(8, "video", (2, 4, 8), [k1, k2])  # 8 tokens per chunk
    long = MediaSpan(8, "video", (3, 4, 8), [k1, k2, k3])
    ids_short = [5] * 8 + [IMG] * 16 + [6] * 24
    ids_long = [5] * 8 + [IMG] * 24 + [6] * 16
    hs = block_hashes(ids_short, [short], B, ROOT)
    hl = block_hashes(ids_long, [long], B, ROOT)
    assert hs[0] == hl[0]  # tokens 0..15 = 8 text + chunk 1 (same key, same offsets)
    assert hs[1] != hl[1]  # tokens 16..31: chunk 2 then text vs chunk 2 then chunk 3


def _reference(ids: list[int], spans: list[MediaSpan], block_size: int, root: bytes) -> list[bytes]:
    """The definition, block by block: tokens, then (key, offset) of every overlapping chunk in order."""
    chunks = []
    for span in sorted(spans, key=lambda s: s.offset):
        n = span.tokens_per_chunk
        chunks += [
            (span.offset + i * n, span.offset + (i + 1) * n, key) for i, key in enumerate(span.chunk_keys)
        ]
    out, prev = [], root
    for b in range(len(ids) // block_size):
        lo, hi = b * block_size, (b + 1) * block_size
        body = struct.pack(f"<{block_size}i", *ids[lo:hi])
        body += b"".join(struct.pack("<16sq", key, lo - s) for s, e, key in chunks if s < hi and e > lo)
        prev = xxhash.xxh3_128_digest(prev + body)
        out.append(prev)
    return out


def test_vectorized_media_path_matches_the_definition():
    """Random prompts with images and videos: chunks smaller than a block (several per block),
    chunks running past the prompt, spans out of order, every input type, known prefixes."""
    import random

    import numpy as np
    import torch

    rng = random.Random(7)
    for _ in range(400):
        block_size = rng.choice([1, 4, 16, 32])
        ids = [rng.randrange(70000) for _ in range(rng.randrange(300))]
        spans, offset = [], rng.randrange(20)
        while offset < len(ids) + 20 and rng.random() < 0.8:
            chunks, per_chunk = rng.randint(1, 5), rng.randint(1, 40)
            keys = [rng.randbytes(16) for _ in range(chunks)]
            spans.append(
                MediaSpan(offset, "video" if chunks > 1 else "image", (chunks, 2, 2 * per_chunk), keys)
            )
            offset += chunks * per_chunk + rng.randrange(30)
        rng.shuffle(spans)
        want = _reference(ids, spans, block_size, ROOT)
        assert block_hashes(ids, spans, block_size, ROOT) == want
        known = want[: rng.randint(0, len(want))]
        assert block_hashes(torch.tensor(ids), spans, block_size, ROOT, known) == want
        assert block_hashes(np.asarray(ids, dtype=np.int64), spans, block_size, ROOT, known) == want
