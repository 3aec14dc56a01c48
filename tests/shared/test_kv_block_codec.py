"""Stored KV block values: a round trip is exact, and every way a value can be wrong is refused
with its reason before any of it is used."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mmcache.shared.keys import BlockHash, Fingerprint
from mmcache.shared.kv_block_codec import HEADER_BYTES, BadValue, KVLayout, StoredBlock, decode, encode

LAYOUT = KVLayout(Fingerprint(b"m" * 16), torch.bfloat16, 4, 2, 1, 8, 3)
HASH = BlockHash(b"h" * 16)


def block(logprobs: bool = True) -> StoredBlock:
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(LAYOUT.kv_shape, generator=gen).to(torch.bfloat16)
    ids = torch.arange(12, dtype=torch.int32).view(4, 3) if logprobs else None
    values = -torch.rand(4, 3, generator=gen) if logprobs else None
    return StoredBlock(HASH, (5, 6, 7, 8), kv, ids, values)


@pytest.mark.parametrize("logprobs", [True, False])
def test_round_trip_is_exact(logprobs):
    b = block(logprobs)
    got = decode(LAYOUT, HASH, encode(LAYOUT, b))
    assert got.token_ids == b.token_ids and torch.equal(got.kv, b.kv)
    if logprobs:
        assert torch.equal(got.logprob_ids, b.logprob_ids) and torch.equal(
            got.logprob_values, b.logprob_values
        )
    else:
        assert got.logprob_ids is None and got.logprob_values is None


def test_keys_differ_by_layout_and_hash():
    keys = {LAYOUT.key(HASH), LAYOUT.key(BlockHash(b"i" * 16))}
    for change in ({"dtype": torch.float32}, {"block_size": 8}, {"num_layers": 3}, {"num_kv_heads": 2},
                   {"head_dim": 16}, {"logprob_width": 4}, {"model": Fingerprint(b"n" * 16)}):  # fmt: skip
        keys.add(dataclasses.replace(LAYOUT, **change).key(HASH))
    assert len(keys) == 9


def corrupt(value: bytes, at: int) -> bytes:
    out = bytearray(value)
    out[at] ^= 0xFF
    return bytes(out)


@pytest.mark.parametrize(
    ("reason", "mutate"),
    [
        ("truncated", lambda v: v[: HEADER_BYTES - 1]),
        ("truncated", lambda v: v[:-1]),
        ("length", lambda v: v + b"\0"),
        ("checksum", lambda v: corrupt(v, len(v) - 1)),
        ("checksum", lambda v: corrupt(v, HEADER_BYTES)),  # a token
        ("format", lambda v: corrupt(v, 0)),
        ("layout", lambda v: corrupt(v, 8)),
        ("hash", lambda v: corrupt(v, 24)),
    ],
)
def test_a_bad_value_is_refused(reason, mutate):
    with pytest.raises(BadValue) as err:
        decode(LAYOUT, HASH, mutate(encode(LAYOUT, block())))
    assert err.value.reason == reason


def test_a_value_for_another_hash_or_layout_is_refused():
    value = encode(LAYOUT, block())
    with pytest.raises(BadValue, match="hash"):
        decode(LAYOUT, BlockHash(b"x" * 16), value)
    with pytest.raises(BadValue, match="layout"):
        decode(dataclasses.replace(LAYOUT, dtype=torch.float16), HASH, value)
