"""No-hit overhead: what the caches cost when nothing can hit.

An all-unique workload: every request carries a new random 448x448 image (a ``data:`` URL) and its
own random system prompt, so no processor, encoder or prefix-cache entry is ever reused. Three
servers run side by side: two with every cache on (A and A') and one with ``--no-cache`` (B).
Each round sends a fresh batch of n concurrent requests to each, the order rotating so that each
server takes every position in turn (A B A', B A' A, A' A B, then the same reversed), and records
output tokens/s. The result is the median over rounds of B's rate over the mean of A's and A''s
(goal <= 1.03: the caches cost at most 3% when they never hit), next to A' over A, the noise floor
of two identical servers on this machine in the same run.

With ``--kv-store`` the same run measures the shared KV tier instead: A and A' share one Redis
(``--kv-store``: every prefix is written there, and every prefix miss asks it first) and B has every
cache but no store; B over A and A' is then what the store costs when it never hits.

``MMCACHE_BENCH_MODEL`` picks the checkpoint (default: the tiny one).

    python -m mmcache.benchmarks.no_hit [--quick] [--kv-store]
"""

from __future__ import annotations

import asyncio
import base64
import os
import statistics
import time
from pathlib import Path

import aiohttp
import numpy as np

from mmcache import results as results_file
from mmcache.benchmarks.chat import MAX_TOKENS, batch, body, image, text, user, warm_up, words
from mmcache.benchmarks.common import Result, Server, main, model_dir, say
from mmcache.kv_store_server import RedisServer

GOAL = 1.03
IMAGE = 448
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=300)


def requests(model: str, seed: int, n: int, system_words: int) -> list[dict]:
    from mmcache.media import image_bytes

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        png = image_bytes(IMAGE, IMAGE, seed=seed * 1000 + i)
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        messages = [
            {"role": "system", "content": words(rng, system_words)},
            user(image(url), text(words(rng, 12))),
        ]
        out.append(body(model, messages))
    return out


async def measure(servers: dict[str, Server], model: str, quick: bool) -> dict[str, list[float]]:
    n = 4 if quick else 8
    rounds = 3 if quick else 6
    system_words = 40 if quick else 60  # ~200 tokens
    seeds = iter(range(1, 100_000))
    rates: dict[str, list[float]] = {name: [] for name in servers}
    async with aiohttp.ClientSession(timeout=REQUEST_TIMEOUT) as session:
        for server in servers.values():
            await warm_up(session, server, requests(model, next(seeds), 2, system_words))
        deadline = time.monotonic() + (60 if quick else 300)
        names = list(servers)  # A, B, A'
        for r in range(rounds):
            # NOTE: each server takes every position in turn (rotated, then reversed): a server
            # always second would carry the position's bias into the ratio.
            order = names[r % 3 :] + names[: r % 3]
            order = order if (r // 3) % 2 == 0 else order[::-1]
            for name in order:
                # NOTE: every server gets payloads of its own (a new image each); the same seed
                # position keeps their sizes alike.
                payloads = requests(model, next(seeds), n, system_words)
                wall, tokens, replies = await batch(session, servers[name], payloads)
                assert tokens == n * MAX_TOKENS, tokens
                cached = sum(x["usage"]["prompt_tokens_details"]["cached_tokens"] for x in replies)
                assert cached == 0, f"an all-unique workload hit the prefix cache ({cached} tokens)"
                rates[name].append(tokens / wall)
            say(
                f"  round {r} ({' '.join(order)}): tokens/s "
                + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items())
                + f"; load {os.getloadavg()[0]:.1f}"
            )
            if time.monotonic() > deadline and r >= 1:
                break
    return rates


def run(quick: bool = False, kv_store: bool = False) -> list[Result]:
    path = model_dir()
    model = path.name
    start = time.perf_counter()
    store = RedisServer().start() if kv_store else None
    on, off = (("--kv-store", store.url), ()) if store else ((), ("--no-cache",))
    servers = {
        "A": Server(path, *on, wait=False),
        "B": Server(path, *off, wait=False),
        "A'": Server(path, *on, wait=False),
    }
    try:
        for server in servers.values():
            server.wait_healthy()
        say(f"# three servers healthy in {time.perf_counter() - start:.1f} s ({path})")
        rates = asyncio.run(measure(servers, model, quick))
    finally:
        for server in servers.values():
            server.stop()
        if store:
            store.stop()
    # NOTE: B against the mean of both cache-on servers: one server instance alone moves the speed
    # by a few percent (the A/A ratio shows how much).
    overhead = [2 * b / (a + a2) for a, b, a2 in zip(rates["A"], rates["B"], rates["A'"], strict=True)]
    noise = [a2 / a for a, a2 in zip(rates["A"], rates["A'"], strict=True)]
    say(f"# B over the mean of A and A' per round: {', '.join(f'{x:.3f}' for x in overhead)}")
    say(f"# A'/A per round: {', '.join(f'{x:.3f}' for x in noise)}")
    what = "store off over the shared KV store on" if store else "--no-cache over caches on"
    name = "no_hit_store_overhead" if store else "no_hit_overhead"
    out = os.environ.get("MMCACHE_BENCH_RESULTS")  # a directory: <date>-no-hit[-kv-store]-<commit>.json
    if out:
        figures = {
            "b_over_a_per_round": [round(x, 3) for x in overhead],
            "median": round(statistics.median(overhead), 3),
            "noise_floor_a_prime_over_a_per_round": [round(x, 3) for x in noise],
            "noise_floor_median": round(statistics.median(noise), 3),
            "tokens_per_s": {k: [round(x, 2) for x in v] for k, v in rates.items()},
            "goal": f"<= {GOAL}",
        }
        body = {"checkpoint": str(path), "measured": what, "rounds": len(overhead), "figures": figures}
        results_file.write(Path(out), results_file.record("no-hit-kv-store" if store else "no-hit", body))
    return [
        Result(
            name,
            f"all-unique (new image + own system prompt) output tokens/s, {what}",
            statistics.median(overhead),
            GOAL,
            higher_is_better=False,
            note=f"A/A noise floor {statistics.median(noise):.3f}, {len(overhead)} rounds",
        ),
        Result(
            f"{name}_noise_floor",
            "the same workload, one server of A's flags over another (A'/A)",
            statistics.median(noise),
            None,
        ),
    ]


if __name__ == "__main__":
    main(run, __doc__, {"kv-store": "measure the shared KV store instead of all caches"})
