"""``prompt_logprobs`` survive prefix-cache hits: cold, warm and a partial hit that ends inside an
image give the same entries as ``--no-cache`` (same token ids, values within 1e-5), and those equal
a log-softmax over Hugging Face's logits. A block cached without prompt logprobs is computed again
for a request that asks (never a missing or stale value); the store shows in /metrics within the
KV budget."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from tests import media
from tests.e2e.server import Server, serving
from tests.e2e.test_exactness import image, reference_inputs, text, user, video
from tests.e2e.util import metrics, ok
from tests.hf_reference import hf_prompt_logprobs

pytestmark = pytest.mark.e2e

K = 4
TOL = 1e-5
PNG = media.image_bytes(224, 224, seed=5)
JPEG = media.image_bytes(300, 200, seed=6, fmt="JPEG")
BIG = media.image_bytes(448, 448, seed=7)
VIDEO = media.video_bytes(8, 224, 224, fps=2, seed=8)

CASES: dict[str, Callable[[], list[dict]]] = {
    "text": lambda: [{"role": "user", "content": "Tell me a story about the sea and the stars."}],
    "one_image": lambda: [user(image(media.data_url(PNG, "image/png")), text("Describe the picture."))],
    "two_images": lambda: [
        user(
            text("Compare"),
            image(media.data_url(PNG, "image/png")),
            text("with"),
            image(media.data_url(JPEG, "image/jpeg")),
        )
    ],
    "video": lambda: [user(video(media.data_url(VIDEO, "video/mp4")), text("What happens?"))],
    "multi_turn": lambda: [
        {"role": "system", "content": "You answer in one short sentence."},
        user(image(media.data_url(PNG, "image/png")), text("What colour dominates?")),
        {"role": "assistant", "content": "Mostly green, with some blue."},
        {"role": "user", "content": "And in the corners?"},
    ],
}


def body(server: Server, messages: list[dict], **extra) -> dict:
    return {
        "model": server.model.name,
        "messages": messages,
        "max_tokens": 2,
        "temperature": 0,
        "prompt_logprobs": K,
        "return_token_ids": True,
        **extra,
    }


def entries(out: dict) -> list[tuple[float, list[int], list[float]]]:
    """Per prompt token after the first: (its logprob, top K ids, top K values)."""
    prompt, got = out["prompt_token_ids"], out["prompt_logprobs"]
    assert len(got) == len(prompt) and got[0] is None
    rows = []
    for token, entry in zip(prompt[1:], got[1:], strict=True):
        own = entry[str(token)]
        assert own["rank"] >= 1 and isinstance(own["decoded_token"], str)
        top = sorted((e["rank"], int(t), e["logprob"]) for t, e in entry.items() if e["rank"] <= K)
        top = [t for t in top if not (int(t[1]) == token and t[0] != own["rank"])][:K]
        assert [r for r, _, _ in top] == list(range(1, K + 1))
        rows.append((own["logprob"], [t for _, t, _ in top], [v for _, _, v in top]))
    return rows


def same(a: dict, b: dict) -> None:
    assert a["prompt_token_ids"] == b["prompt_token_ids"]
    for (own_a, ids_a, val_a), (own_b, ids_b, val_b) in zip(entries(a), entries(b), strict=True):
        assert ids_a == ids_b
        assert math.isclose(own_a, own_b, abs_tol=TOL)
        assert val_a == pytest.approx(val_b, abs=TOL)


def matches_hf(server: Server, messages: list[dict], out: dict) -> None:
    ids, ref = hf_prompt_logprobs(server.model, *reference_inputs(messages))
    assert out["prompt_token_ids"] == ids
    for j, (own, _, values) in enumerate(entries(out)):
        assert math.isclose(own, float(ref[j, ids[j + 1]]), abs_tol=TOL)
        assert values == pytest.approx(ref[j].topk(K).values.tolist(), abs=TOL)


@pytest.mark.parametrize("case", list(CASES))
def test_cold_and_warm_equal_no_cache_and_transformers(server, baseline, case) -> None:
    messages = CASES[case]()
    if case == "multi_turn":  # its prefix first cached by a request that asks for no logprobs
        plain = ok(server, {**body(server, messages), "prompt_logprobs": None})
        assert "prompt_logprobs" not in plain
    cold = ok(server, body(server, messages))
    warm = ok(server, body(server, messages))
    reference = ok(baseline, body(baseline, messages))
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert reference["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for out in (cold, warm):
        same(out, reference)
        assert out["choices"][0]["token_ids"] == reference["choices"][0]["token_ids"]
    matches_hf(server, messages, warm)


def test_store_is_in_metrics_within_the_kv_budget(server) -> None:
    ok(server, body(server, CASES["text"]()))
    m = metrics(server)
    assert m["mmcache_llm_prompt_logprob_store_bytes"] > 0
    assert m["mmcache_llm_prompt_logprob_blocks"] > 0
    used = m["mmcache_llm_kv_cache_capacity_bytes"] + m["mmcache_llm_prompt_logprob_store_bytes"]
    assert used <= m["mmcache_llm_kv_budget_bytes"]


@pytest.fixture(scope="module")
def small_kv(tiny_model):
    """A KV pool of 24 blocks: an image request and a text request cannot both stay cached."""
    with serving(tiny_model, "--num-kv-blocks", "24") as server:
        yield server


def test_partial_hit_inside_an_image(small_kv, baseline) -> None:
    """A text request evicts the tail blocks of an image request (freed tail first); the image
    request again hits a prefix that ends inside the image, with the same prompt logprobs."""
    messages = [user(image(media.data_url(BIG, "image/png")), text("What is in it?"))]
    first = ok(small_kv, body(small_kv, messages))
    prompt = first["prompt_token_ids"]
    pad = max(set(prompt), key=prompt.count)
    image_start, image_end = prompt.index(pad), len(prompt) - prompt[::-1].index(pad)
    filler = [{"role": "user", "content": "Tell me a story about the harbor town. " * 14}]
    ok(small_kv, {**body(small_kv, filler), "prompt_logprobs": None})
    again = ok(small_kv, body(small_kv, messages))
    hit = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert image_start < hit < image_end
    reference = ok(baseline, body(baseline, messages))
    same(first, reference)
    same(again, reference)
    matches_hf(small_kv, messages, again)


def test_streamed_prompt_logprobs_come_once_and_equal_the_answer(server, client) -> None:
    messages = CASES["one_image"]()
    whole = ok(server, body(server, messages))
    stream = client.chat.completions.create(
        model=server.model.name,
        messages=messages,
        temperature=0,
        max_tokens=2,
        stream=True,
        extra_body={"prompt_logprobs": K},
    )
    got = [c.model_extra["prompt_logprobs"] for c in stream if c.model_extra.get("prompt_logprobs")]
    assert len(got) == 1
    same({**whole, "prompt_logprobs": got[0]}, whole)
