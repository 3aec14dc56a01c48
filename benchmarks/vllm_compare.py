"""mmcache side by side with another OpenAI-compatible server (vLLM), interleaved, on one checkpoint.

Both servers must already run (see docs/performance.md for the commands); this script only sends
requests, the same kinds to both, alternating A B B A within every row so background load hits
them alike, and prints one line per row: the medians and B's figure over A's where a larger ratio
means mmcache is ahead. Before each sample it waits (up to 3 s) for the machine to go quiet: an
idle server's threads may keep a core busy after its last request (vLLM's CPU worker spun at 100%
of a core for ~1-1.5 s after each request on a 2-core VM, 2026-12-06), and a sample sent to the
other server in that time ran on what was left.

Rows (6 samples each by default):
  text_ttft     TTFT of a text request with a new ~220-token prompt (nothing cached)
  image_ttft    TTFT of a request with a first-seen 448x448 image (a ``data:`` URL) and a question
  same_image    TTFT of a new question about the image the previous request sent (warm caches)
  decode_ms     ms per output token of one streamed request at batch 1 (64 tokens): from the first
                content to the usage chunk, over the 63 tokens after the first
  concurrent    output tokens/s of 16 concurrent requests, each a new image and question
and the greedy texts of both servers on the text prompts (equal count; compare with --dtype float32
on both sides: bf16 kernels differ), with ``--hf DIR`` transformers' texts on the checkpoint too.

    python -m mmcache.benchmarks.vllm_compare --mmcache http://127.0.0.1:8000 --peer http://127.0.0.1:8001
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import NamedTuple

import aiohttp
import numpy as np

from mmcache import results as results_file
from mmcache.benchmarks.chat import body, image, text, user, words
from mmcache.loadgen.runner import sse_events

IMAGE = 448
DECODE_TOKENS = 64
CONCURRENT = 16
TIMEOUT = aiohttp.ClientTimeout(total=600)


class Streamed(NamedTuple):
    times: list[float]  # arrival of each content chunk, seconds from sending
    text: str
    end: float  # arrival of the usage chunk, after the last token
    tokens: int  # completion tokens, as the usage chunk counts them


class NoContent(RuntimeError):
    """A random checkpoint answered with special tokens only (nothing to time)."""


async def timed(peer: Peer, session: aiohttp.ClientSession, draw: Callable[[], dict]) -> Streamed:
    """A stream with content; a prompt answered with special tokens only is drawn again (a random
    checkpoint does that now and then), at most 5 times."""
    for _ in range(4):
        try:
            return await peer.stream(session, draw())
        except NoContent:
            continue
    return await peer.stream(session, draw())


class Peer:
    """One server: its URL and the model name it serves."""

    def __init__(self, name: str, url: str):
        self.name, self.url, self.model = name, url.rstrip("/"), ""

    async def connect(self, session: aiohttp.ClientSession) -> None:
        async with session.get(self.url + "/v1/models") as resp:
            self.model = (await resp.json())["data"][0]["id"]

    async def stream(
        self, session: aiohttp.ClientSession, payload: dict, need_content: bool = True
    ) -> Streamed:
        """Arrival times (seconds from sending) of every content chunk, the text (a random model's
        greedy answer may be special tokens only: empty, allowed with ``need_content`` off), and
        when the usage chunk (sent after the last token) came with its completion token count."""
        data = json.dumps(
            {**payload, "model": self.model, "stream": True, "stream_options": {"include_usage": True}}
        ).encode()
        start = time.perf_counter()
        times: list[float] = []
        parts: list[str] = []
        end, tokens = 0.0, 0
        headers = {"Content-Type": "application/json"}
        async with session.post(self.url + "/v1/chat/completions", data=data, headers=headers) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{self.name}: HTTP {resp.status}: {await resp.text()}")
            async for event in sse_events(resp):
                for choice in event.get("choices", []):
                    content = choice.get("delta", {}).get("content")
                    if content:
                        times.append(time.perf_counter() - start)
                        parts.append(content)
                if event.get("usage"):
                    end, tokens = time.perf_counter() - start, int(event["usage"]["completion_tokens"])
        if not times and need_content:
            raise NoContent(f"{self.name}: the stream carried no content")
        return Streamed(times, "".join(parts), end, tokens)

    async def complete(self, session: aiohttp.ClientSession, payload: dict) -> int:
        async with session.post(
            self.url + "/v1/chat/completions", json={**payload, "model": self.model}
        ) as resp:
            out = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"{self.name}: HTTP {resp.status}: {out}")
            return int(out["usage"]["completion_tokens"])


class Workload:
    """Fresh payloads: every call draws new words and, where asked, a new image.

    Every request sets ``ignore_eos`` (both servers take it): a random checkpoint may end its answer
    at once, and a timing row needs the tokens it asks for.
    """

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.seed = seed * 10_000
        self.last_image = ""

    def image_url(self) -> str:
        from mmcache.media import image_bytes

        self.seed += 1
        png = image_bytes(IMAGE, IMAGE, seed=self.seed)
        self.last_image = "data:image/png;base64," + base64.b64encode(png).decode()
        return self.last_image

    def text(self, max_tokens: int = 16) -> dict:
        # ~60 words of system prompt + ~8 words of question: ~220 tokens with the chat template.
        messages = [
            {"role": "system", "content": words(self.rng, 60)},
            {"role": "user", "content": words(self.rng, 8)},
        ]
        return {**body("", messages, max_tokens=max_tokens), "ignore_eos": True}

    def image(self, url: str | None = None, max_tokens: int = 16) -> dict:
        content = [image(url or self.image_url()), text(words(self.rng, 8))]
        return {**body("", [user(*content)], max_tokens=max_tokens), "ignore_eos": True}


QUIET_BUSY = 0.2  # of all cores: below this, the machine counts as quiet
QUIET_WAIT_S = 3.0


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot (None where /proc/stat is missing)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


async def quiet(window_s: float = 0.1) -> float:
    """Wait until the CPUs are below QUIET_BUSY over a ``window_s`` window, at most QUIET_WAIT_S;
    returns the seconds waited."""
    start = time.perf_counter()
    while (before := _cpu_times()) is not None:
        await asyncio.sleep(window_s)
        after = _cpu_times()
        if after is None or after[1] == before[1]:
            break
        busy = (after[0] - before[0]) / (after[1] - before[1])
        if busy < QUIET_BUSY or time.perf_counter() - start > QUIET_WAIT_S:
            break
    return time.perf_counter() - start


async def row(
    name: str, peers: list[Peer], rounds: int, sample: Callable[[Peer, int], Awaitable[float]], higher: bool
) -> dict:
    """``rounds`` samples per peer, in A B B A order; returns the medians and B over A (mmcache ahead > 1)."""
    values: dict[str, list[float]] = {p.name: [] for p in peers}
    for r in range(rounds):
        for peer in peers if r % 2 == 0 else peers[::-1]:
            await quiet()
            values[peer.name].append(await sample(peer, r))
    a, b = (statistics.median(values[p.name]) for p in peers)
    ratio = a / b if higher else b / a
    spread = {k: [round(min(v), 4), round(max(v), 4)] for k, v in values.items()}
    print(
        f"ROW {name}: {peers[0].name} {a:.4g}, {peers[1].name} {b:.4g} -> {ratio:.2f}x "
        f"({'higher' if higher else 'lower'} is better; min..max {spread}; load {os.getloadavg()[0]:.1f})",
        flush=True,
    )
    return {"mmcache": a, "peer": b, "ratio": ratio, "samples": values}


ROWS = ("text_ttft", "image_ttft", "same_image", "decode_ms", "concurrent", "greedy_texts")


async def compare(
    peers: list[Peer], rounds: int, texts_only: bool = False, rows: set[str] | None = None, hf: str = ""
) -> dict:
    """Every row (or those in ``rows``), in the order of :data:`ROWS`."""
    out: dict = {}
    # NOTE: a fresh connection per request, for both servers alike: uvicorn (vLLM) closes a
    # keep-alive connection after 5 s idle, and a pooled one reused after that is reset.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=TIMEOUT, connector=connector) as session:
        for peer in peers:
            await peer.connect(session)
        if texts_only:
            out["greedy_texts"] = await greedy_texts(peers, session, hf)
            return out
        # NOTE: seeds new to each run, so a second run against the same servers is not served from
        # the prefix caches the first one filled.
        base = int(time.time())
        loads = {p.name: Workload(base + seed) for seed, p in enumerate(peers)}
        for peer in peers:  # warm-up: both compile / allocate what they need before timing
            await timed(peer, session, loads[peer.name].text)
            await timed(peer, session, loads[peer.name].image)

        async def text_ttft(peer: Peer, _r: int) -> float:
            return (await timed(peer, session, loads[peer.name].text)).times[0]

        async def image_ttft(peer: Peer, _r: int) -> float:
            return (await timed(peer, session, loads[peer.name].image)).times[0]

        async def same_image(peer: Peer, _r: int) -> float:
            load = loads[peer.name]
            url = load.image_url()
            await peer.stream(session, load.image(url, max_tokens=1), need_content=False)  # now seen
            return (await timed(peer, session, lambda: load.image(url))).times[0]

        async def decode_ms(peer: Peer, _r: int) -> float:
            # NOTE: per token, not per chunk: a token may carry no text (a special token, or part
            # of a character a server holds back), and a server may send several in one chunk.
            # From the first content to the usage chunk, over the tokens after the first.
            got = await timed(peer, session, lambda: loads[peer.name].text(max_tokens=DECODE_TOKENS))
            assert got.tokens == DECODE_TOKENS, f"{peer.name}: {got.tokens} tokens"
            return 1e3 * (got.end - got.times[0]) / (got.tokens - 1)

        async def concurrent(peer: Peer, _r: int) -> float:
            load = loads[peer.name]
            payloads = [load.image(max_tokens=32) for _ in range(CONCURRENT)]
            start = time.perf_counter()
            tokens = await asyncio.gather(*(peer.complete(session, p) for p in payloads))
            return sum(tokens) / (time.perf_counter() - start)

        table = {
            "text_ttft": ("text_ttft_s", rounds, text_ttft, False),
            "image_ttft": ("image_ttft_s", rounds, image_ttft, False),
            "same_image": ("same_image_ttft_s", rounds, same_image, False),
            "decode_ms": ("decode_ms", rounds, decode_ms, False),
            "concurrent": ("concurrent_tok_s", max(2, rounds // 2), concurrent, True),
        }
        for name, (key, n, sample, higher) in table.items():
            if rows is None or name in rows:
                out[key] = await row(name, peers, n, sample, higher=higher)
        if rows is None or "greedy_texts" in rows:
            out["greedy_texts"] = await greedy_texts(peers, session, hf)
    return out


async def greedy_texts(peers: list[Peer], session: aiohttp.ClientSession, hf: str = "") -> dict:
    """Both servers' greedy answers to the same 6 prompts (text only): how many are equal; with
    ``hf`` (a checkpoint directory), transformers' answers too (:mod:`.hf_texts`), and how many of
    each server's equal them."""
    same = Workload(999)
    prompts = [same.text(max_tokens=24) for _ in range(6)]
    texts = {p.name: [(await p.stream(session, q, need_content=False)).text for q in prompts] for p in peers}
    equal = sum(x == y for x, y in zip(*texts.values(), strict=True))
    out = {"equal": equal, "prompts": len(prompts), "texts": texts}
    line = f"ROW greedy_texts: {equal}/{len(prompts)} equal"
    if hf:
        from mmcache.benchmarks.hf_texts import greedy_texts as hf_texts

        texts["hf"] = await asyncio.to_thread(hf_texts, hf, prompts)
        for p in peers:
            out[f"equal_hf_{p.name}"] = same_hf = sum(
                x == y for x, y in zip(texts[p.name], texts["hf"], strict=True)
            )
            line += f", {p.name} = HF {same_hf}/{len(prompts)}"
    print(line, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mmcache", required=True, help="mmcache's URL")
    parser.add_argument("--peer", required=True, help="the other server's URL (e.g. vllm serve)")
    parser.add_argument("--rounds", type=int, default=6, help="samples per row and server")
    parser.add_argument(
        "--texts-only", action="store_true", help="only compare greedy texts (serve both in float32 for this)"
    )
    parser.add_argument(
        "--hf",
        default="",
        metavar="DIR",
        help="also compare both servers' greedy texts with transformers' on DIR",
    )
    parser.add_argument(
        "--results-dir", default="", help="write the figures there as <date>-vllm-compare-<commit>.json"
    )
    parser.add_argument(
        "--rows", default="", help=f"comma-separated rows to run (default all: {', '.join(ROWS)})"
    )
    args = parser.parse_args()
    rows = set(filter(None, args.rows.split(","))) or None
    if rows and not rows <= set(ROWS):
        parser.error(f"--rows: unknown {sorted(rows - set(ROWS))}; choose from {', '.join(ROWS)}")
    if args.rounds < 2:
        parser.error("--rounds must be >= 2 (A B B A order)")
    peers = [Peer("mmcache", args.mmcache), Peer("peer", args.peer)]
    result = asyncio.run(compare(peers, args.rounds, args.texts_only, rows, args.hf))
    if args.results_dir:
        path = results_file.write(Path(args.results_dir), results_file.record("vllm-compare", result))
        print(f"# wrote {path}", flush=True)


if __name__ == "__main__":
    main()
