"""Every cache tier proves its hit (counters, cached_tokens) and that the answer is unchanged
(identical greedy tokens to a server running with --no-cache)."""

from __future__ import annotations

import pytest

from tests.e2e.server import Server
from tests.e2e.util import chat, image_part, metrics, ok, post_many, tokens, video_part
from tests.media import image_bytes, video_bytes

pytestmark = pytest.mark.e2e

BLOCK = 16


def name(server: Server) -> str:
    return server.model.name


def test_repeated_image_is_not_decoded_or_encoded_again(server, baseline):
    img = image_bytes(448, 448, seed=11)
    first = ok(
        server, chat(name(server), [image_part(img), {"type": "text", "text": "Describe it."}], system="S1")
    )
    assert first["usage"]["mm_cache"]["processor_misses"] == 1
    before = metrics(server)
    # Another system prompt: the prefix cache cannot cover the image, so the encoder tier is asked.
    body = chat(
        name(server), [image_part(img), {"type": "text", "text": "Describe it."}], system="Another one"
    )
    second = ok(server, body)
    after = metrics(server)
    assert after["mmcache_processor_media_decodes_total"] == before["mmcache_processor_media_decodes_total"]
    assert after["mmcache_encoder_forwards_total"] == before["mmcache_encoder_forwards_total"]
    assert second["usage"]["mm_cache"] == {
        "processor_hits": 1,
        "processor_misses": 0,
        "encoder_hits": 1,
        "encoder_misses": 0,
        "prefix_skipped": 0,
    }
    assert tokens(second) == tokens(ok(baseline, body))


def test_repeated_request_hits_the_prefix_cache_and_skips_the_encoder(server, baseline):
    body = chat(name(server), [image_part(image_bytes(300, 200, seed=12)), {"type": "text", "text": "Hi"}])
    first = ok(server, body)
    before = metrics(server)
    second = ok(server, body)
    after = metrics(server)
    prompt = second["usage"]["prompt_tokens"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt - 1) // BLOCK * BLOCK
    assert second["usage"]["mm_cache"]["prefix_skipped"] == 1
    assert (
        after["mmcache_encoder_fetches_total"] == before["mmcache_encoder_fetches_total"]
    )  # no rows pulled at all
    assert tokens(first) == tokens(second) == tokens(ok(baseline, body))


def test_two_salts_never_share_an_entry(server):
    img = image_bytes(448, 448, seed=13)
    content = [image_part(img), {"type": "text", "text": "What is it?"}]
    a = ok(server, chat(name(server), content, cache_salt="tenant-a"))
    before = metrics(server)
    b = ok(server, chat(name(server), content, cache_salt="tenant-b"))
    after = metrics(server)
    assert b["usage"]["mm_cache"]["processor_misses"] == 1
    assert b["usage"]["mm_cache"]["encoder_misses"] == 1
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert after["mmcache_encoder_forwards_total"] == before["mmcache_encoder_forwards_total"] + 1
    again = ok(server, chat(name(server), content, cache_salt="tenant-a"))
    assert again["usage"]["mm_cache"]["processor_hits"] == 1
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert tokens(a) == tokens(b) == tokens(again)


def test_uuid_stands_for_its_bytes_only_within_its_salt(server):
    img = image_bytes(224, 224, seed=14)
    text = {"type": "text", "text": "And this?"}
    with_data = ok(server, chat(name(server), [image_part(img, uuid="photo-1"), text], cache_salt="t1"))
    by_uuid = ok(
        server, chat(name(server), [{"type": "image_url", "uuid": "photo-1"}, text], cache_salt="t1")
    )
    assert by_uuid["usage"]["mm_cache"]["processor_hits"] == 1
    assert tokens(by_uuid) == tokens(with_data)
    for salt in ("t2", None):
        extra = {"cache_salt": salt} if salt else {}
        status, err = server.post(
            "/v1/chat/completions",
            chat(name(server), [{"type": "image_url", "uuid": "photo-1"}, text], **extra),
        )
        assert status == 400
        assert "photo-1" in err["error"]["message"]
        assert err["error"]["code"] == "unknown_uuid"


def test_concurrent_requests_for_one_new_image_run_one_forward(server, baseline):
    img = image_bytes(448, 448, seed=15)
    body = chat(name(server), [image_part(img), {"type": "text", "text": "Eight at once."}])
    before = metrics(server)
    outs = post_many(server, [body] * 8)
    after = metrics(server)
    assert after["mmcache_encoder_forwards_total"] - before["mmcache_encoder_forwards_total"] == 1
    assert (
        after["mmcache_processor_media_decodes_total"] - before["mmcache_processor_media_decodes_total"] == 1
    )
    expected = tokens(ok(baseline, body))
    assert all(tokens(o) == expected for o in outs)


def test_growing_video_encodes_only_new_chunks_and_partially_hits(server, baseline):
    """The first 8 frames of a clip, then the first 16 (two different files)."""
    short, long = video_bytes(8, seed=21), video_bytes(16, seed=21)
    text = {"type": "text", "text": "What happens?"}
    short_out = ok(server, chat(name(server), [video_part(short), text]))
    assert short_out["usage"]["mm_cache"]["encoder_misses"] == 4  # 8 frames = 4 temporal chunks
    before = metrics(server)
    body = chat(name(server), [video_part(long), text])
    long_out = ok(server, body)
    after = metrics(server)
    usage = long_out["usage"]
    assert after["mmcache_encoder_chunks_encoded_total"] - before["mmcache_encoder_chunks_encoded_total"] == 4
    # The prefix cache ends inside the video, exactly where the first new chunk starts: the full
    # blocks before it, then the shared start of the block that holds that boundary (copied).
    video_start = _first_video_token(long_out["prompt_token_ids"])
    per_chunk = 64  # 224x224 frames → 16x16 patches → 64 tokens per temporal chunk
    shared_end = video_start + 4 * per_chunk
    cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
    assert shared_end % BLOCK  # the boundary is inside a block ...
    assert cached_tokens == shared_end  # ... and the prefix still reaches it
    rows = (
        after["mmcache_llm_embedding_rows_fetched_total"] - before["mmcache_llm_embedding_rows_fetched_total"]
    )
    assert rows == 4 * per_chunk  # only the new chunks' rows
    assert tokens(long_out) == tokens(ok(baseline, body))


def _first_video_token(prompt_ids: list[int]) -> int:
    # The video's placeholder id is the most frequent token of this prompt (512 of them).
    video_id = max(set(prompt_ids), key=prompt_ids.count)
    return prompt_ids.index(video_id)


def test_multi_turn_reuses_the_first_turn(server, baseline):
    img = image_bytes(448, 448, seed=16)
    turn1 = chat(
        name(server), [image_part(img), {"type": "text", "text": "Tell me about it."}], system="Be brief."
    )
    out1 = ok(server, turn1)
    turn2 = dict(turn1)
    turn2["messages"] = [
        *turn1["messages"],
        {"role": "assistant", "content": out1["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And the colours?"},
    ]
    out2 = ok(server, turn2)
    prompt1 = out1["usage"]["prompt_tokens"]
    assert out2["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt1 // BLOCK * BLOCK
    assert out2["usage"]["mm_cache"]["prefix_skipped"] == 1
    assert tokens(out2) == tokens(ok(baseline, turn2))


def test_the_same_image_twice_in_one_request(server, baseline):
    """One chunk, two places: encoded once, fetched once (one hand-off pin), answers agree."""
    img = image_bytes(224, 224, seed=17)
    body = chat(name(server), [image_part(img), {"type": "text", "text": "Same?"}, image_part(img)])
    before = metrics(server)
    out = ok(server, body)
    after = metrics(server)
    assert out["usage"]["mm_cache"]["encoder_misses"] == 1
    assert after["mmcache_encoder_forwards_total"] - before["mmcache_encoder_forwards_total"] == 1
    assert after["mmcache_encoder_fetches_total"] - before["mmcache_encoder_fetches_total"] == 1
    assert tokens(out) == tokens(ok(baseline, body))
