"""What constrained decoding and logits processing cost, through ``mmcache serve`` (HTTP, 3 stages).

16 concurrent text requests (distinct questions, greedy) in three kinds, rounds interleaved on one
server so that all see the same background load:
- plain: free text;
- processed: the same with presence, frequency and repetition penalties and a logit_bias (every
  row of every step goes through the batched logits processors);
- json_schema: the same with a ``response_format`` schema (llguidance masks every step; the
  grammar is compiled once, in the warm-up, and copied per request).
Output tokens/s of each over plain's; every kind ends each request at its token budget or, with
the schema, where the object closes (that is counted as it is: tokens generated).
"""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np

from mmcache.benchmarks.chat import batch, body, warm_up, words
from mmcache.benchmarks.common import Result, Server, main, median, model_dir, say

CONCURRENCY = 16
MAX_TOKENS = 128
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1800, "maximum": 2100},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "kind": {"enum": ["book", "film", "song"]},
    },
    "required": ["title", "year", "tags", "kind"],
    "additionalProperties": False,
}
PROCESSED = {
    "presence_penalty": 0.5,
    "frequency_penalty": 0.3,
    "repetition_penalty": 1.1,
    "logit_bias": {"42": -5},
}


def _payloads(model: str, kind: str, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(CONCURRENCY):
        messages = [{"role": "user", "content": "Describe " + words(rng, 12)}]
        payload = body(model, messages, MAX_TOKENS)
        if kind == "processed":
            payload.update(PROCESSED)
        elif kind == "json_schema":
            payload["ignore_eos"] = False  # the grammar's end is the answer's end
            payload["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "item", "schema": SCHEMA},
            }
        out.append(payload)
    return out


def run(quick: bool = False) -> list[Result]:
    kinds = ("plain", "processed", "json_schema")
    rounds = 2 if quick else 8
    rates: dict[str, list[float]] = {k: [] for k in kinds}
    server = Server(model_dir())
    try:
        model = server.model_name()

        async def go() -> None:
            timeout = aiohttp.ClientTimeout(total=300)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                for kind in kinds:
                    await warm_up(session, server, _payloads(model, kind, 10_000))
                for r in range(rounds):
                    for kind in kinds if r % 2 == 0 else reversed(kinds):
                        wall, tokens, _ = await batch(session, server, _payloads(model, kind, r * 10 + 1))
                        rates[kind].append(tokens / wall)
                        say(
                            f"  round {r} {kind}: {tokens} tokens in {wall:.2f} s = {tokens / wall:.0f} tok/s"
                        )

        asyncio.run(go())
    finally:
        server.stop()
    plain = median(rates["plain"])
    results = []
    for kind, what in (
        ("processed", "penalties + logit_bias"),
        ("json_schema", "json_schema response_format"),
    ):
        ratios = [a / b for a, b in zip(rates[kind], rates["plain"], strict=True)]
        results.append(
            Result(
                f"structured_{kind}",
                f"output tokens/s, {CONCURRENCY} concurrent requests with {what} / plain "
                f"({median(rates[kind]):.0f} vs {plain:.0f} tok/s; {min(ratios):.2f}-{max(ratios):.2f}x "
                f"over {len(ratios)} rounds)",
                median(ratios),
                None,
            )
        )
    return results


if __name__ == "__main__":
    main(run, __doc__)
