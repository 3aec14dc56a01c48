"""Memory pressure never fails a request: a small KV pool (preemption and eviction certain), an
encoder cache that holds about one image, and concurrent conversations whose prefixes are cached
while their images' embeddings are gone. A preempted request whose prefix was then evicted needs
rows nobody holds (the cached prefix covered them, so they were never fetched); the LLM stage has
the processor re-encode them on the live request. Every request succeeds and answers exactly as
with --no-cache."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.server import Server
from tests.e2e.util import chat, image_part, metrics, tokens
from tests.media import image_bytes

pytestmark = pytest.mark.e2e

SYSTEM = "You describe pictures for people who cannot see them: shapes first, then colours."
QUESTIONS = ["What is this?", "Describe the colours.", "Count the shapes.", "Where is the light?", "Why?"]
IMAGES = [image_bytes(336, 336, seed) for seed in (61, 62, 63, 64)]


def bodies(seed: int) -> tuple[list[dict], list[dict]]:
    """Four requests about the four images, one at a time; then twelve about the same images."""
    rng = random.Random(seed)

    def ask(image: bytes) -> dict:
        question = {"type": "text", "text": " ".join(rng.sample(QUESTIONS, 3))}
        return chat("m", [image_part(image), question], system=SYSTEM, max_tokens=rng.randint(24, 40))

    return [ask(image) for image in IMAGES], [ask(rng.choice(IMAGES)) for _ in range(12)]


def send(server: Server, body: dict) -> tuple[int, list[int] | dict]:
    status, out = server.post("/v1/chat/completions", {**body, "model": server.model.name})
    return status, tokens(out) if status == 200 else out


PRESSURE = (  # the pressured server's flags
    *("--num-kv-blocks", "30", "--max-num-batched-tokens", "32", "--max-num-seqs", "8"),
    *("--encoder-cache-gb", "0.0001"),
)


SEEDS = [1, 2, 3, 4, 5]
REPAIRS: dict[int, int] = {}  # seed → mid-request repairs it caused


@pytest.mark.parametrize("seed", SEEDS)
def test_no_request_fails_under_memory_pressure(pressured, baseline, seed: int):
    warm, burst = bodies(seed)
    before = metrics(pressured)
    got = [send(pressured, b) for b in warm]
    with ThreadPoolExecutor(len(burst)) as pool:
        got += list(pool.map(lambda b: send(pressured, b), burst))
    expected = [send(baseline, b) for b in warm + burst]
    after = metrics(pressured)
    moved = {
        name: int(after[f"mmcache_{name}_total"] - before.get(f"mmcache_{name}_total", 0))
        for name in ("llm_preemptions", "llm_kv_evictions", "llm_repairs", "llm_prefix_cache_hits")
    }
    failed = [(i, out) for i, (status, out) in enumerate(got) if status != 200]
    print(f"seed {seed}: sent {len(got)}, failed {len(failed)}, {moved}")
    assert failed == []
    mismatches = [i for i, (g, e) in enumerate(zip(got, expected, strict=True)) if g != e]
    assert mismatches == [], f"{len(mismatches)} of {len(got)} answers changed: {mismatches}"
    assert moved["llm_preemptions"] >= 1 and moved["llm_kv_evictions"] >= 1
    assert moved["llm_prefix_cache_hits"] > 0
    REPAIRS[seed] = moved["llm_repairs"]


def test_rows_were_re_encoded_for_live_requests():
    """Across the seeds, preempted requests whose cached prefix (covering their image) was evicted
    needed rows no encoder held, and got them re-encoded mid-request (counted by the LLM stage)."""
    assert set(REPAIRS) == set(SEEDS), "the pressure runs above did not all pass"
    assert sum(REPAIRS.values()) >= 1, REPAIRS
