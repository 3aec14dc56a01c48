"""Chat requests for the server benchmarks: bodies, random words, completion and TTFT clients."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import numpy as np

from mmcache.benchmarks.common import Server, say
from mmcache.loadgen.runner import sse_events

MAX_TOKENS = 32


_SYLLABLES = [
    a + b
    for a in ("", "b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "v", "w")
    for b in ("a", "e", "i", "o", "u", "an", "en", "or", "is", "ul")
]


def words(rng: np.random.Generator, n: int) -> str:
    """``n`` random pronounceable words (distinct text for every seed)."""
    counts = rng.integers(1, 4, n)
    picks = rng.integers(0, len(_SYLLABLES), int(counts.sum()))
    out, i = [], 0
    for c in counts:
        out.append("".join(_SYLLABLES[j] for j in picks[i : i + c]))
        i += c
    return " ".join(out)


def user(*parts: dict) -> dict:
    return {"role": "user", "content": list(parts)}


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def body(model: str, messages: list[dict], max_tokens: int = MAX_TOKENS, stream: bool = False) -> dict:
    out = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    if stream:
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}
    return out


async def complete(session: aiohttp.ClientSession, server: Server, payload: dict) -> dict:
    async with session.post(server.url + "/v1/chat/completions", json=payload) as resp:
        data = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {data}")
        return data


async def ttft(session: aiohttp.ClientSession, server: Server, payload: dict) -> tuple[float, dict]:
    """Seconds from sending the request to its first chunk with content, and the usage of the stream.

    The body is serialized before the clock starts: encoding a 680 KB ``data:`` URL into JSON
    costs this client ~4 ms, which is the client's time, not the server's.
    """
    data = json.dumps(payload).encode()
    start = time.perf_counter()
    first = None
    usage: dict = {}
    url = server.url + "/v1/chat/completions"
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for event in sse_events(resp):
            if "error" in event:
                raise RuntimeError(f"stream error: {event}")
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                if first is None and choice.get("delta", {}).get("content"):
                    first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("the stream carried no content")
    return first, usage


async def batch(session, server: Server, payloads: list[dict]) -> tuple[float, int, list[dict]]:
    """Send all at once; (wall seconds, completion tokens, responses)."""
    start = time.perf_counter()
    replies = await asyncio.gather(*(complete(session, server, p) for p in payloads))
    wall = time.perf_counter() - start
    tokens = sum(r["usage"]["completion_tokens"] for r in replies)
    return wall, tokens, replies


async def warm_up(session, server: Server, payloads: list[dict], attempts: int = 3) -> None:
    """Warm-up batch; a fresh server on a busy machine may refuse the very first requests
    (seen: 504 from the 5 s probe timeout), so retry a bounded number of times and say so."""
    for attempt in range(1, attempts + 1):
        try:
            await batch(session, server, payloads)
            return
        except RuntimeError as exc:
            say(f"  WARNING: warm-up attempt {attempt} on {server.url} failed: {exc}")
            if attempt == attempts:
                raise
            await asyncio.sleep(2.0)
