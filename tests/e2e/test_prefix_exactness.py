"""A cache hit never changes an answer: a seeded, randomized workload of text, images, videos,
multi-turn conversations and shared system prompts gives the same greedy tokens with every cache
on — under eviction pressure (a KV pool of 48 blocks, a tiny encoder cache) and preemption — as with
--no-cache."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.server import Server
from tests.e2e.util import chat, image_part, metrics, ok, tokens, video_part
from tests.media import image_bytes, video_bytes

pytestmark = pytest.mark.e2e

SYSTEMS = [
    "You are a careful assistant who describes pictures and videos in plain words, briefly.",
    "Answer like a museum guide: name the main shapes, the colours and the light in the scene.",
    "Be terse.",
]
QUESTIONS = [
    "What is this?",
    "Describe the colours.",
    "What moves?",
    "Count the shapes.",
    "Any text?",
    "Why?",
]


def workload(seed: int, n: int) -> list[dict]:
    rng = random.Random(seed)
    images = [
        image_bytes(448, 448, 41),
        image_bytes(300, 200, 42),
        image_bytes(224, 224, 43),
        image_bytes(336, 224, 44),
    ]
    videos = [video_bytes(8, seed=45), video_bytes(16, seed=45)]  # a growing clip
    bodies: list[dict] = []
    for _ in range(n):
        kind = rng.choice(["text", "image", "image", "two_images", "video", "turn"])
        question = {"type": "text", "text": rng.choice(QUESTIONS)}
        system = rng.choice(SYSTEMS)
        max_tokens = rng.randint(4, 14)
        if kind == "turn" and bodies:
            base = rng.choice([b for b in bodies if b["_size"] < 400] or bodies[:1])
            body = {
                **base,
                "messages": [
                    *base["messages"],
                    {"role": "assistant", "content": "fine"},
                    {"role": "user", "content": rng.choice(QUESTIONS)},
                ],
            }
            body["max_tokens"] = max_tokens
        elif kind == "text":
            body = chat("m", rng.choice(QUESTIONS) * rng.randint(1, 4), system=system, max_tokens=max_tokens)
        elif kind == "image":
            body = chat("m", [image_part(rng.choice(images)), question], system=system, max_tokens=max_tokens)
        elif kind == "two_images":
            a, b = rng.sample(images[1:], 2)
            body = chat("m", [image_part(a), question, image_part(b)], system=system, max_tokens=max_tokens)
        else:
            body = chat("m", [video_part(rng.choice(videos)), question], system=system, max_tokens=max_tokens)
        body["_size"] = {"text": 80, "image": 340, "two_images": 420, "video": 600, "turn": 500}[kind]
        bodies.append(body)
    return bodies


def send(server: Server, body: dict) -> list[int]:
    clean = {k: v for k, v in body.items() if not k.startswith("_")}
    clean["model"] = server.model.name
    return tokens(ok(server, clean))


# The pressured server's flags: chunked prefill (64 tokens a step) admits sequences before their
# whole prompt has blocks, so concurrent prompts outgrow the 48-block pool and preempt each other.
PRESSURE = (
    *("--num-kv-blocks", "48", "--max-num-seqs", "4", "--max-num-batched-tokens", "64"),
    *("--encoder-cache-gb", "0.0003"),
)


def test_cache_on_equals_cache_off_under_pressure(pressured, baseline):
    bodies = workload(seed=7, n=28)
    expected = [send(baseline, b) for b in bodies]
    # Rounds of 4 concurrent requests: they compete for 48 KV blocks.
    got: list[list[int]] = []
    with ThreadPoolExecutor(4) as pool:
        for i in range(0, len(bodies), 4):
            got += list(pool.map(lambda b: send(pressured, b), bodies[i : i + 4]))
    mismatches = [i for i, (g, e) in enumerate(zip(got, expected, strict=True)) if g != e]
    assert mismatches == [], f"{len(mismatches)} of {len(bodies)} answers changed: {mismatches}"
    m = metrics(pressured)
    print(
        {
            k.removeprefix("mmcache_"): int(v)
            for k, v in m.items()
            if "hits" in k or "evictions" in k or "preemptions" in k or "queries" in k or "repairs" in k
        }
    )
    assert m["mmcache_llm_prefix_cache_hits_total"] > 0  # the cache did serve tokens ...
    assert m["mmcache_llm_kv_evictions_total"] > 0  # ... while blocks were being evicted ...
    assert m["mmcache_llm_preemptions_total"] > 0  # ... and sequences preempted
    assert m["mmcache_encoder_cache_evictions_total"] > 0
    assert m["mmcache_processor_cache_hits_total"] > 0
