"""TTFT with the shared KV tier, end to end through ``mmcache serve`` (HTTP, streamed).

Three servers: A and B share one Redis (``--kv-store``), C has no store. Each round builds a new
prefix (a ~2k-token system prompt, optionally with a 448x448 image) that no server has seen, then:

1. **computed**: A answers question 1 (nothing cached anywhere; A writes the prefix's blocks);
2. **local hit**: A answers question 2 (the prefix is in A's own pool);
3. **store hit**: B answers question 3 (B never saw the prefix: its blocks come from the store);
4. **no hit, store off**: C answers a prompt of its own, as new as A's in step 1.

Reported: store hit / computed and store hit / local hit (TTFT ratios, medians over rounds), and
the no-hit overhead of the store (A's step 1 over C's step 4: every prefix new, one store lookup
that misses). A and C are different processes (a few percent apart on their own); the rounds
interleave them so the machine's noise hits both alike. With an image, B's probe reports the
store's prefix, so B's processor does not encode the image.

    python -m mmcache.benchmarks.kv_tier [--quick]      (MMCACHE_BENCH_MODEL=DIR for another checkpoint)
"""

from __future__ import annotations

import asyncio
import os
import time

import aiohttp
import numpy as np

from mmcache.benchmarks.chat import body, image, text, ttft, user, words
from mmcache.benchmarks.common import Result, Server, main, median, model_dir, say, spread
from mmcache.kv_store_server import RedisServer
from mmcache.media import data_url, image_bytes

SYSTEM_WORDS = 600  # ~2k tokens
MAX_TOKENS = 4
SETTLE_SECONDS = 0.3  # A's writer stores the prefix's blocks in a few ms; wait well past that


def messages(rng: np.random.Generator, system: str, with_image: bytes | None) -> list[dict]:
    question = text(words(rng, 8) + "?")
    parts = [image(data_url(with_image, "image/png")), question] if with_image else [question]
    return [{"role": "system", "content": system}, user(*parts)]


async def rounds(a: Server, b: Server, c: Server, n: int, with_image: bool) -> dict[str, list[float]]:
    rng = np.random.default_rng(7 if with_image else 3)
    out: dict[str, list[float]] = {k: [] for k in ("computed", "local", "store", "no_store")}
    cached: list[int] = []
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for i in range(n + 1):  # round 0 warms every server up, unrecorded
            system = words(rng, SYSTEM_WORDS)
            img = image_bytes(448, 448, seed=1000 + i) if with_image else None
            other = image_bytes(448, 448, seed=5000 + i) if with_image else None
            model = a.model_name()
            t_computed, _ = await ttft(session, a, body(model, messages(rng, system, img), MAX_TOKENS, True))
            t_local, _ = await ttft(session, a, body(model, messages(rng, system, img), MAX_TOKENS, True))
            await asyncio.sleep(SETTLE_SECONDS)
            t_store, usage = await ttft(session, b, body(model, messages(rng, system, img), MAX_TOKENS, True))
            mine = messages(rng, words(rng, SYSTEM_WORDS), other)
            t_none, _ = await ttft(session, c, body(model, mine, MAX_TOKENS, True))
            if i:
                for key, value in zip(out, (t_computed, t_local, t_store, t_none), strict=True):
                    out[key].append(value)
                cached.append(usage["prompt_tokens_details"]["cached_tokens"])
    say(f"# cached tokens of the store hits: {cached}")
    return out


def run(quick: bool = False) -> list[Result]:
    model = model_dir()
    n = 4 if quick else 10
    store = RedisServer().start()
    servers: list[Server] = []
    results: list[Result] = []
    try:
        for flags in (("--kv-store", store.url), ("--kv-store", store.url), ()):
            servers.append(Server(model, *flags))  # one after the other: a busy machine starts slowly
        a, b, c = servers
        for with_image in (False, True):
            kind = "image" if with_image else "text"
            say(f"# {kind}: load average before {os.getloadavg()}")
            started = time.perf_counter()
            t = asyncio.run(rounds(a, b, c, n, with_image))
            say(f"# {kind}: {time.perf_counter() - started:.0f} s, load average after {os.getloadavg()}")
            for key, xs in t.items():
                say(f"#   TTFT {key:9}: {spread(xs)}")
            store_vs_computed = [s / c_ for s, c_ in zip(t["store"], t["computed"], strict=True)]
            store_vs_local = [s / lo for s, lo in zip(t["store"], t["local"], strict=True)]
            overhead = [x / y for x, y in zip(t["computed"], t["no_store"], strict=True)]
            for name, xs in (
                ("store_vs_computed", store_vs_computed),
                ("store_vs_local", store_vs_local),
                ("no_hit_overhead", overhead),
            ):
                say(f"#   {name}: median {median(xs):.3f} (min {min(xs):.3f}, max {max(xs):.3f})")
            results += [
                Result(
                    f"kv_tier.{kind}.store_vs_computed",
                    f"TTFT of a store hit on a fresh replica over the same prefix computed ({kind})",
                    median(store_vs_computed),
                    None,
                ),
                Result(
                    f"kv_tier.{kind}.store_vs_local",
                    f"TTFT of a store hit over a local-pool hit ({kind})",
                    median(store_vs_local),
                    None,
                ),
                Result(
                    f"kv_tier.{kind}.no_hit_overhead",
                    f"TTFT of a new prefix with the store on over off ({kind}; different processes)",
                    median(overhead),
                    1.03,
                    higher_is_better=False,
                ),
            ]
    finally:
        for s in servers:
            s.stop()
        store.stop()
    return results


if __name__ == "__main__":
    main(run, __doc__)
