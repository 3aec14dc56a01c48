"""Cache identities: every field matters, framing is unambiguous, fingerprints ignore order."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import xxhash

from mmcache.shared.keys import (
    Fingerprint,
    chunk_key,
    embed_key,
    fingerprint,
    hash_fields,
    media_key,
    salt_bytes,
    uuid_media_key,
)

FP = fingerprint("processor", [("min_pixels", 3136), ("max_pixels", 200704)])
FP2 = fingerprint("processor", [("min_pixels", 3136), ("max_pixels", 200705)])
DATA = b"\x89PNG\r\n\x1a\n-some-image-bytes"


def test_keys_are_16_byte_xxh3_128_digests():
    key = media_key(None, "image", DATA, FP)
    assert isinstance(key, bytes) and len(key) == 16
    assert len(FP) == 16
    assert len(chunk_key(None, b"px", (1, 1, 2), FP)) == 16


def test_hash_fields_is_xxh3_128_over_length_prefixed_fields():
    expected = xxhash.xxh3_128()
    for part in (b"tag", b"ab", b""):
        expected.update(len(part).to_bytes(8, "little"))
        expected.update(part)
    assert hash_fields(b"tag", b"ab", b"") == expected.digest()


def test_keys_are_deterministic():
    assert media_key("s", "image", DATA, FP) == media_key("s", "image", bytes(DATA), FP)
    assert fingerprint("t", [("a", 1)]) == fingerprint("t", [("a", 1)])


def test_salt_none_empty_and_text_all_differ():
    keys = {media_key(salt, "image", DATA, FP) for salt in (None, "", "a", "b", "a\x00")}
    assert len(keys) == 5
    assert salt_bytes(None) != salt_bytes("")


@pytest.mark.parametrize(
    "change",
    [
        {"salt": "tenant"},
        {"modality": "video"},
        {"data": DATA + b"\x00"},
        {"data": DATA[:-1]},
        {"data": b"X" + DATA[1:]},
        {"fp": FP2},
    ],
    ids=["salt", "modality", "bytes_longer", "bytes_shorter", "bytes_first", "fingerprint"],
)
def test_media_key_changes_with_each_field(change):
    base = {"salt": None, "modality": "image", "data": DATA, "fp": FP}
    changed = {**base, **change}
    assert media_key(base["salt"], base["modality"], base["data"], base["fp"]) != media_key(
        changed["salt"], changed["modality"], changed["data"], changed["fp"]
    )


def test_media_key_accepts_any_buffer_of_the_same_bytes():
    arr = np.frombuffer(DATA, dtype=np.uint8)
    ref = media_key(None, "image", DATA, FP)
    assert media_key(None, "image", bytearray(DATA), FP) == ref
    assert media_key(None, "image", memoryview(DATA), FP) == ref
    assert media_key(None, "image", arr, FP) == ref


def test_length_prefix_framing_separates_fields():
    assert hash_fields(b"t", b"ab", b"c") != hash_fields(b"t", b"a", b"bc")
    assert hash_fields(b"t", b"abc") != hash_fields(b"t", b"ab", b"c")
    assert hash_fields(b"t", b"", b"a") != hash_fields(b"t", b"a", b"")
    assert hash_fields(b"t", b"a") != hash_fields(b"t", b"a", b"")
    assert hash_fields(b"ta", b"b") != hash_fields(b"t", b"ab")  # the tag is framed too


def test_framing_at_the_key_level():
    # salt "a" + modality "bimage" vs salt "ab" + modality "image": the same concatenation.
    assert media_key("a", "bimage", DATA, FP) != media_key("ab", "image", DATA, FP)
    # the media bytes and the fingerprint cannot trade bytes either
    fp = Fingerprint(b"\x01" * 16)
    assert media_key(None, "image", DATA + b"\x01", Fingerprint(b"\x01" * 15)) != media_key(
        None, "image", DATA, fp
    )


def test_uuid_key_differs_from_byte_key_and_depends_on_salt():
    uuid = "item-1"
    assert uuid_media_key(None, "image", uuid, FP) != media_key(None, "image", uuid.encode(), FP)
    assert uuid_media_key(None, "image", uuid, FP) != uuid_media_key("s", "image", uuid, FP)
    assert uuid_media_key(None, "image", uuid, FP) != uuid_media_key(None, "video", uuid, FP)
    assert uuid_media_key(None, "image", uuid, FP) != uuid_media_key(None, "image", "item-2", FP)
    assert uuid_media_key(None, "image", uuid, FP) == uuid_media_key(None, "image", uuid, FP)


def test_chunk_key_depends_on_shape_pixels_salt_and_fingerprint():
    pixels = np.arange(2 * 3 * 4 * 6, dtype=np.uint8).reshape(2, 3, 4, 6)
    base = chunk_key(None, pixels, pixels.shape, FP)
    assert chunk_key(None, pixels, (2, 3, 6, 4), FP) != base  # same bytes, other layout
    assert chunk_key(None, pixels, (1, 6, 4, 6), FP) != base
    assert chunk_key(None, pixels, (2, 3, 24), FP) != base  # fewer dims
    other = pixels.copy()
    other[1, 2, 3, 5] ^= 1
    assert chunk_key(None, other, pixels.shape, FP) != base
    assert chunk_key("", pixels, pixels.shape, FP) != base
    assert chunk_key(None, pixels, pixels.shape, FP2) != base
    assert chunk_key(None, pixels.tobytes(), pixels.shape, FP) == base
    assert chunk_key(None, pixels, list(pixels.shape), FP) == base


def test_chunk_key_differs_from_media_key_of_the_same_bytes():
    pixels = b"\x00" * 12
    assert chunk_key(None, pixels, (12,), FP) != media_key(None, "image", pixels, FP)


def test_embed_key_depends_on_chunk_and_vision_fingerprint():
    c1 = chunk_key(None, b"\x01" * 12, (12,), FP)
    c2 = chunk_key(None, b"\x02" * 12, (12,), FP)
    v1 = fingerprint("vision", [("weights", "aa"), ("dtype", "torch.float32")])
    v2 = fingerprint("vision", [("weights", "aa"), ("dtype", "torch.bfloat16")])
    assert len({embed_key(c1, v1), embed_key(c2, v1), embed_key(c1, v2)}) == 3
    assert embed_key(c1, v1) == embed_key(c1, v1)


def test_fingerprint_ignores_input_order():
    settings = [("min_pixels", 3136), ("max_pixels", 200704), ("mean", (0.5, 0.4)), ("fps", 2.0)]
    ref = fingerprint("processor", settings)
    for perm in itertools.permutations(settings):
        assert fingerprint("processor", list(perm)) == ref
    assert fingerprint("processor", iter(reversed(settings))) == ref


@pytest.mark.parametrize(
    "other",
    [
        [("a", 1), ("b", 3)],  # value
        [("a", 1), ("c", 2)],  # name
        [("a", 1)],  # missing setting
        [("a", 1), ("b", 2), ("c", None)],  # extra setting
        [("a", 1), ("b", 2.0)],  # 2 vs 2.0
        [("a", 1), ("b", "2")],  # 2 vs "2"
        [("b", 1), ("a", 2)],  # values swapped between names
        [("ab", 1), ("", 2)],  # names re-split
    ],
)
def test_fingerprint_is_sensitive_to_values_and_names(other):
    assert fingerprint("t", [("a", 1), ("b", 2)]) != fingerprint("t", other)


def test_fingerprint_depends_on_tag():
    assert fingerprint("processor", [("a", 1)]) != fingerprint("vision", [("a", 1)])
