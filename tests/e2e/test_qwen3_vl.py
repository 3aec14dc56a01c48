"""Qwen3-VL through every cache tier: partial prefix hits inside a growing video and inside an image
fetch only the remaining rows of every feature set (the merged embedding and the three deepstack
sets), and the answers equal HF ``generate`` on the same checkpoint.

(Greedy exactness over text, images, videos and several turns, cold and warm, is
``test_exactness.py``, which covers Qwen3-VL with the other families.)
"""

from __future__ import annotations

import pytest

from tests.e2e.server import Server, serving
from tests.e2e.test_exactness import reference_inputs
from tests.e2e.util import chat, image_part, metrics, ok, tokens, video_part
from tests.hf_reference import hf_generate
from tests.media import image_bytes, video_bytes

pytestmark = pytest.mark.e2e

BLOCK = 16
FEATURE_SETS = 4  # merged + deepstack layers 0, 1, 2 of the tiny checkpoint
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["qwen3-vl"]


@pytest.fixture(scope="module")
def server(model):
    with serving(model) as s:
        yield s


def counters(server: Server) -> dict[str, float]:
    m = metrics(server)
    return {
        "rows": m["mmcache_llm_embedding_rows_fetched_total"],
        "feature_rows": m["mmcache_llm_embedding_feature_rows_fetched_total"],
        "encoded": m["mmcache_encoder_chunks_encoded_total"],
    }


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def matches_hf(model, body: dict, out: dict) -> None:
    ref = hf_generate(model, *reference_inputs(body["messages"]), max_new_tokens=body["max_tokens"])
    assert out["prompt_token_ids"] == ref.prompt_token_ids
    assert tokens(out) == ref.token_ids


def spans_of(ids: list[int], pad: int) -> list[tuple[int, int]]:
    """(start, end) of every run of ``pad`` tokens."""
    runs, start = [], None
    for i, t in enumerate([*ids, -1]):
        if t == pad and start is None:
            start = i
        elif t != pad and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_growing_video_reuses_its_leading_chunks_and_their_timestamps(model, server):
    """8 frames, then 16 frames of the same clip: the second prompt equals the first through the
    4th chunk (timestamps included), the prefix cache ends exactly there, only the 4 new chunks
    are encoded and only their rows, of every feature set, are fetched."""
    question = {"type": "text", "text": "What happens?"}
    short = chat(model.name, [video_part(video_bytes(8, seed=31)), question], max_tokens=MAX_TOKENS)
    long = chat(model.name, [video_part(video_bytes(16, seed=31)), question], max_tokens=MAX_TOKENS)
    short_out = ok(server, short)
    assert short_out["usage"]["mm_cache"]["encoder_misses"] == 4
    before = counters(server)
    long_out = ok(server, long)
    moved = delta(counters(server), before)
    matches_hf(model, short, short_out)
    matches_hf(model, long, long_out)

    ids_short, ids_long = short_out["prompt_token_ids"], long_out["prompt_token_ids"]
    pad = max(set(ids_long), key=ids_long.count)  # the video placeholder
    runs = spans_of(ids_long, pad)
    assert len(runs) == 8 and spans_of(ids_short, pad) == runs[:4]  # one run per chunk
    per_chunk = runs[0][1] - runs[0][0]
    assert per_chunk == 49  # 224x224 frames → 14x14 patches of 16 pixels → 7x7 tokens
    shared_end = runs[3][1] + 1  # through the 4th chunk's vision end
    assert ids_long[:shared_end] == ids_short[:shared_end]  # timestamps of the shared part agree
    assert ids_long[shared_end] != ids_short[shared_end]  # the 5th chunk's "<4.2 seconds>"

    assert long_out["usage"]["prompt_tokens_details"]["cached_tokens"] == shared_end
    assert moved["encoded"] == 4
    assert moved["rows"] == 4 * per_chunk
    assert moved["feature_rows"] == 4 * per_chunk * FEATURE_SETS


def test_repeat_is_served_from_the_prefix_and_fetches_nothing(model, server):
    body = chat(
        model.name, [image_part(image_bytes(448, 448, seed=32)), {"type": "text", "text": "Describe."}]
    )
    first = ok(server, body)
    before = counters(server)
    again = ok(server, body)
    moved = delta(counters(server), before)
    prompt = again["usage"]["prompt_tokens"]
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    # Every full block, and the shared start of the block the first answer filled; the last prompt
    # token is computed again for its logits. The image lies wholly inside: nothing is fetched.
    assert (prompt - 1) // BLOCK * BLOCK <= cached <= prompt - 1
    assert moved == {"rows": 0, "feature_rows": 0, "encoded": 0}
    assert tokens(first) == tokens(again)
    matches_hf(model, body, first)


@pytest.fixture(scope="module")
def small_kv(model):
    """A KV pool of 20 blocks: one image request and one text request cannot both stay cached."""
    with serving(model, "--num-kv-blocks", "20") as s:
        yield s


def test_partial_hit_inside_an_image_fetches_only_its_tail(model, small_kv):
    """A text request evicts the tail blocks of an image request (freed tail first); the image request
    again hits a prefix that ends inside the image, and fetches only the image rows after it (of
    every feature set) from the encoder cache, which still holds the whole image."""
    body = chat(
        model.name,
        [image_part(image_bytes(448, 448, seed=33)), {"type": "text", "text": "What is in it?"}],
        max_tokens=4,
    )
    first = ok(small_kv, body)
    prompt = first["prompt_token_ids"]
    pad = max(set(prompt), key=prompt.count)
    ((image_start, image_end),) = spans_of(prompt, pad)
    assert image_end - image_start == 196  # 448x448 → 28x28 patches → 14x14 tokens
    filler = chat(model.name, "Tell me a story about the harbor town. " * 14, max_tokens=2)
    ok(small_kv, filler)
    before = counters(small_kv)
    again = ok(small_kv, body)
    moved = delta(counters(small_kv), before)
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert image_start < cached < image_end and cached % BLOCK == 0  # inside the image, full blocks
    assert moved["encoded"] == 0  # the encoder cache still has the image
    assert moved["rows"] == image_end - cached
    assert moved["feature_rows"] == (image_end - cached) * FEATURE_SETS
    assert tokens(again) == tokens(first)
    matches_hf(model, body, again)
