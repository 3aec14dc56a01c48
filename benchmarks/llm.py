"""End-to-end through ``mmcache serve`` (three processes, HTTP): throughput, cache overhead, TTFT.

(a) 16 concurrent requests (a distinct 448x448 image + a distinct question each, greedy,
    max_tokens 32, ignore_eos) against sequential HF ``model.generate`` of the same requests
    on the same tiny checkpoint in this process (HF processor included), output tokens/s
    (goal >= 3x). mmcache and HF rounds alternate, so both see the same background load;
    HF runs with one torch thread (its fastest setting for this model here).
(b) An all-unique workload (every request its own random prompt, random system message
    first, so no two share even one block) on a server with the
    prefix cache on vs one started with ``--no-cache``: output tokens/s ratio (goal >= 0.97x).
    Rounds alternate between the two servers; every round has new prompts, so nothing repeats.
    Two such pairs run one after the other (started in either order), since a process instance
    alone moves the speed by a few percent; the ratio is the median over all rounds.
(c) TTFT (request sent -> first streamed content chunk) of a request whose system prompt and
    448x448 image (a ``data:`` URL) are cached, over the TTFT of a text-only request with the
    same new question (goal <= 1.5x); for a typical (~200-token) and a long (~2k-token) system
    prompt. NOTE: on this tiny model attention over the cached context is most of a prefill's
    compute, so the long prompt's new tokens cost several times a short prompt's; on a real-size
    model the MLPs dominate and that share shrinks. Every request asks a new question; the
    kinds alternate. The same with the image named by ``uuid`` (no bytes sent) and as a
    ``file://`` URL (a settled file is known by its path and status, so it is not read), and for
    context a text request with the cached system prompt but no image.
The servers of a pair start at once; the second pair's cached server then serves (a) and (c).
They run with the environment users give them; ``MMCACHE_BENCH_SERVER_THREADS=N`` sets
``OMP_NUM_THREADS=N`` for every stage.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

from mmcache.benchmarks.chat import MAX_TOKENS, batch, body, image, text, ttft, user, warm_up, words
from mmcache.benchmarks.common import Result, Server, main, median, model_dir, say, spread

THROUGHPUT_GOAL = 3.0
NO_CACHE_GOAL = 0.97
TTFT_GOAL = 1.5
IMAGE = 448
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=300)
SYSTEM_PROMPTS = {"typical": 60, "long": 600}  # (c): words in the system prompt (~200 / ~2k tokens)
# The servers run as users run them (torch picks its own thread count) unless this is set:
# MMCACHE_BENCH_SERVER_THREADS=1 gives each stage process OMP_NUM_THREADS=1.
THREADS = os.environ.get("MMCACHE_BENCH_SERVER_THREADS", "")

# --- (a) throughput vs HF -------------------------------------------------------------------------------


def _throughput_requests(model: str, media: Path, seed: int, n: int) -> tuple[list[dict], list[tuple]]:
    """n requests (a distinct image file + a distinct question); also the HF form of each."""
    from mmcache.media import image_bytes

    rng = np.random.default_rng(seed)
    payloads, hf = [], []
    for i in range(n):
        data = image_bytes(IMAGE, IMAGE, seed=seed * 1000 + i)
        path = media / f"tp-{seed}-{i}.png"
        path.write_bytes(data)
        question = "Describe this picture: " + words(rng, 12)
        payloads.append(body(model, [user(image(f"file://{path}"), text(question))]))
        hf.append((data, question))
    return payloads, hf


async def throughput(session, server: Server, model: str, media: Path, hf, quick: bool) -> dict:
    """Rounds of 16 concurrent requests, each round followed by HF on the same requests (so both
    see the same background load)."""
    n = 16
    rounds = 1 if quick else 5
    hf_per_round = 4 if quick else n
    warm, warm_hf = _throughput_requests(model, media, 900, 4)
    await warm_up(session, server, warm)
    hf(warm_hf[:1], 60.0)
    ours, theirs = [], []
    for r in range(rounds):
        payloads, hf_requests = _throughput_requests(model, media, 100 + r, n)
        wall, tokens, _ = await batch(session, server, payloads)
        assert tokens == n * MAX_TOKENS, tokens
        ours.append(tokens / wall)
        hf_wall, hf_tokens = hf(hf_requests[:hf_per_round], 5.0 if quick else 15.0)
        theirs.append(hf_tokens / hf_wall)
        say(
            f"  round {r}: mmcache {n} concurrent requests, {tokens} tokens in {wall:.2f} s "
            f"({ours[-1]:.1f} tokens/s); HF sequential {hf_tokens // MAX_TOKENS} requests, "
            f"{hf_tokens} tokens in {hf_wall:.2f} s ({theirs[-1]:.1f} tokens/s)"
        )
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    return {"ratio": median(ratios), "ours": median(ours), "hf": median(theirs)}


def hf_generator(model_path: Path):
    """``hf(requests, budget_s) -> (seconds, new tokens)``: plain transformers, one request after
    another (until done or ``budget_s`` has passed), HF processor included (as mmcache's time
    includes its preprocessing). It runs with one torch thread: for this tiny model that is HF's
    fastest setting on a small machine (two threads only add OpenMP barrier waits), and it keeps
    the baseline from collapsing when other processes want the cores."""
    import io

    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    processor = AutoProcessor.from_pretrained(model_path)
    model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch.float32).eval()

    def one(data: bytes, question: str) -> int:
        img = Image.open(io.BytesIO(data))
        img.load()
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        inputs = processor(text=[prompt], images=[img], return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(
                **inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False
            )
        return out.shape[1] - inputs["input_ids"].shape[1]

    def run(requests: list[tuple], budget_s: float) -> tuple[float, int]:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            start = time.perf_counter()
            tokens = 0
            for r in requests:
                tokens += one(*r)
                if time.perf_counter() - start > budget_s:
                    break
            return time.perf_counter() - start, tokens
        finally:
            torch.set_num_threads(threads)

    return run


# --- (b) prefix cache on vs off, all-unique ------------------------------------------------------------


def _unique_requests(model: str, seed: int, n: int, num_words: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        body(
            model,
            [
                {"role": "system", "content": words(rng, 8)},
                {"role": "user", "content": words(rng, num_words)},
            ],
        )
        for _ in range(n)
    ]


async def cache_overhead(session, on: Server, off: Server, model: str, quick: bool, seed0: int) -> dict:
    """Rounds of n concurrent unique requests, the same payloads to both servers, in ABBA order;
    returns the rates and the per-round (on / off) ratios, measured back to back."""
    n = 8 if quick else 16
    num_words = 100 if quick else 200
    rounds = 2 if quick else 5
    seed = iter(range(seed0, seed0 + 10_000))
    for server in (on, off):
        await warm_up(session, server, _unique_requests(model, next(seed), 4, num_words))
    before = on.metrics()
    rates: dict[str, list[float]] = {"on": [], "off": []}
    prompt_tokens = 0
    deadline = time.monotonic() + (10 if quick else 45)
    for r in range(rounds):
        payloads = _unique_requests(model, next(seed), n, num_words)
        order = [("on", on), ("off", off)] if r % 2 == 0 else [("off", off), ("on", on)]
        for name, server in order:
            wall, tokens, replies = await batch(session, server, payloads)
            assert tokens == n * MAX_TOKENS, tokens
            cached = sum(x["usage"]["prompt_tokens_details"]["cached_tokens"] for x in replies)
            assert cached == 0, f"an all-unique workload hit the prefix cache ({cached} tokens)"
            prompt_tokens = sum(x["usage"]["prompt_tokens"] for x in replies) // n
            rates[name].append(tokens / wall)
        say(
            f"  round {r}: {n} requests, output tokens/s cache on {rates['on'][-1]:.1f}, "
            f"--no-cache {rates['off'][-1]:.1f}"
        )
        if time.monotonic() > deadline and r >= 1:
            break
    after = on.metrics()
    name = "mmcache_llm_prefix_cache_hits_total"
    hits = after.total(name) - before.total(name)
    say(f"  ~{prompt_tokens} prompt tokens per request; prefix-cache hits during the run: {hits:.0f} tokens")
    return rates | {"ratios": [a / b for a, b in zip(rates["on"], rates["off"], strict=True)]}


# --- (c) TTFT with cached image + system prompt ---------------------------------------------------------


async def ttft_cached(
    session, server: Server, model: str, media: Path, quick: bool, system_words: int
) -> dict:
    from mmcache.media import data_url, image_bytes
    from mmcache.processor.media_source import SETTLED_SECONDS

    rng = np.random.default_rng(5 + system_words)
    system = {"role": "system", "content": "You are a careful assistant. " + words(rng, system_words)}
    png = image_bytes(IMAGE, IMAGE, seed=77)
    url = data_url(png, "image/png")
    path = media / f"ttft-{system_words}.png"
    path.write_bytes(png)
    await asyncio.sleep(SETTLED_SECONDS)  # as a file that was not just written: known by its status

    def cached_request(question: str) -> dict:
        return body(model, [system, user(image(url), text(question))], max_tokens=4, stream=True)

    def uuid_request(question: str) -> dict:
        """The same image named by its uuid only (vLLM-compatible): the bytes need not travel again."""
        return body(
            model,
            [system, user({"type": "image_url", "uuid": "bench-image"}, text(question))],
            max_tokens=4,
            stream=True,
        )

    def file_request(question: str) -> dict:
        """The same image as a local file: a repeat is known by its path and status, not read."""
        return body(model, [system, user(image(f"file://{path}"), text(question))], max_tokens=4, stream=True)

    def text_request(question: str) -> dict:
        return body(model, [user(text(question))], max_tokens=4, stream=True)

    def text_system_request(question: str) -> dict:
        return body(model, [system, user(text(question))], max_tokens=4, stream=True)

    # the first request puts the system prompt and the image into every cache tier
    _, usage = await ttft(session, server, cached_request("Warm up, please. " + words(rng, 10)))
    long_prompt = usage["prompt_tokens"]
    named = cached_request("Warm up with a name. " + words(rng, 10))
    named["messages"][1]["content"][0]["uuid"] = "bench-image"
    await ttft(session, server, named)
    for _ in range(2):
        await ttft(session, server, file_request("Warm up from a file. " + words(rng, 10)))
    for _ in range(2):
        await ttft(session, server, text_request(words(rng, 10) + "?"))
        await ttft(session, server, text_system_request(words(rng, 10) + "?"))
    n = 6 if quick else 25
    times: dict[str, list[float]] = {
        "cached": [],
        "cached-uuid": [],
        "cached-file": [],
        "text": [],
        "text+system": [],
    }
    cached_tokens = []
    deadline = time.monotonic() + (15 if quick else 60)
    for _ in range(n):
        question = "Now tell me: " + words(rng, 10) + "?"
        t, usage = await ttft(session, server, cached_request(question))
        times["cached"].append(t)
        cached_tokens.append(usage["prompt_tokens_details"]["cached_tokens"])
        assert usage["mm_cache"]["processor_hits"] == 1, usage
        # its own question: the same question again would find its tokens cached (the image's
        # pixels are the same, so are its chunk keys), which no user's new question does
        t, usage = await ttft(session, server, uuid_request("Now tell me: " + words(rng, 10) + "?"))
        times["cached-uuid"].append(t)
        assert usage["mm_cache"]["processor_hits"] == 1, usage
        t, usage = await ttft(session, server, file_request("Now tell me: " + words(rng, 10) + "?"))
        times["cached-file"].append(t)
        assert usage["mm_cache"]["processor_hits"] == 1, usage
        t, _ = await ttft(session, server, text_request(question))
        times["text"].append(t)
        t, _ = await ttft(session, server, text_system_request(question))
        times["text+system"].append(t)
        if time.monotonic() > deadline and len(times["cached"]) >= 3:
            break
    say(f"  cached request: {long_prompt} prompt tokens, {median(cached_tokens):.0f} of them cached")
    say(f"  TTFT, cached system prompt + image + new question: {spread(times['cached'])}")
    say(f"  TTFT, same with the image by uuid (bytes not re-sent): {spread(times['cached-uuid'])}")
    say(f"  TTFT, same with the image as a file:// URL (not read again): {spread(times['cached-file'])}")
    say(f"  TTFT, text-only new question: {spread(times['text'])}")
    say(f"  TTFT, cached system prompt + new question (no image): {spread(times['text+system'])}")
    return {k: median(v) for k, v in times.items()} | {
        "cached_tokens": median(cached_tokens),
        "prompt_tokens": long_prompt,
    }


def _start_pair(model_path: Path, media: Path, on_first: bool) -> tuple[Server, Server]:
    """A server with every cache and one with ``--no-cache``, started at once (in either order)."""
    env = {"OMP_NUM_THREADS": THREADS} if THREADS else None
    start = time.perf_counter()
    servers = {}
    for name in ("on", "off") if on_first else ("off", "on"):
        flags = () if name == "on" else ("--no-cache",)
        servers[name] = Server(model_path, *flags, media_dir=media, env=env, wait=False)
    for server in servers.values():
        server.wait_healthy()
    say(f"  two servers healthy in {time.perf_counter() - start:.1f} s")
    return servers["on"], servers["off"]


async def _served(model_path: Path, media: Path, quick: bool) -> tuple[dict, dict, dict]:
    """(b) on two pairs of servers (a few percent of speed comes with a process instance, not
    with its settings: two of each halve that), then (a) and (c) on the second cached one."""
    hf = hf_generator(model_path)
    running: list[Server] = []
    try:
        rates: dict[str, list[float]] = {"on": [], "off": [], "ratios": []}
        async with aiohttp.ClientSession(timeout=REQUEST_TIMEOUT) as session:
            say("# llm (b): all-unique workload, prefix cache on vs --no-cache")
            for pair, on_first in enumerate((True, False)):
                on, off = _start_pair(model_path, media, on_first)
                running += [on, off]
                model = on.model_name()
                measured = await cache_overhead(session, on, off, model, quick, 10_000 * (pair + 1))
                for key, values in measured.items():
                    rates[key] += values
                off.stop()
                if pair == 0:
                    on.stop()
            overhead = {
                "ratio": median(rates["ratios"]),
                "on": median(rates["on"]),
                "off": median(rates["off"]),
            }
            say("# llm (a): 16 concurrent requests vs sequential HF generate")
            tput = await throughput(session, on, model, media, hf, quick)
            first = {}
            for label, n in SYSTEM_PROMPTS.items():
                say(f"# llm (c): TTFT with a cached {label} system prompt and image vs a text-only request")
                first[label] = await ttft_cached(session, on, model, media, quick, n)
    finally:
        for server in running:
            leftover = server.stop()
            if leftover:
                say(f"  WARNING: had to kill leftover processes {sorted(leftover)}")
    return tput, overhead, first


def run(quick: bool = False) -> list[Result]:
    model_path = model_dir()
    media = Path(tempfile.mkdtemp(prefix="mmcache-bench-llm-"))
    try:
        tput, overhead, first = asyncio.run(_served(model_path, media, quick))
    finally:
        shutil.rmtree(media, ignore_errors=True)
    return [
        Result(
            "llm.throughput_vs_hf",
            "output tokens/s, 16 concurrent image requests via mmcache / sequential HF generate",
            tput["ratio"],
            THROUGHPUT_GOAL,
            details={"mmcache_tps": tput["ours"], "hf_tps": tput["hf"]},
        ),
        Result(
            "llm.cache_overhead",
            "output tokens/s on an all-unique workload, prefix cache on / --no-cache",
            overhead["ratio"],
            NO_CACHE_GOAL,
            details={"on_tps": overhead["on"], "off_tps": overhead["off"]},
        ),
        *(
            Result(
                f"llm.ttft_cached_media_{label}",
                f"TTFT, cached {label} system prompt + image + new question "
                f"({t['prompt_tokens']} prompt tokens) / text-only new question",
                t["cached"] / t["text"],
                TTFT_GOAL,
                higher_is_better=False,
                details={
                    "ttft_cached_s": t["cached"],
                    "ttft_text_s": t["text"],
                    "ttft_text_system_s": t["text+system"],
                    "cached_over_text_system": t["cached"] / t["text+system"],
                },
            )
            for label, t in first.items()
        ),
        *(
            Result(
                f"llm.ttft_cached_media_{label}_{form}",
                f"TTFT, as above with the image {how} ({t['prompt_tokens']} prompt tokens) "
                "/ text-only new question",
                t[f"cached-{form}"] / t["text"],
                TTFT_GOAL,
                higher_is_better=False,
                details={f"ttft_cached_{form}_s": t[f"cached-{form}"], "ttft_text_s": t["text"]},
            )
            for label, t in first.items()
            for form, how in (("uuid", "named by uuid"), ("file", "as a file:// URL"))
        ),
    ]


if __name__ == "__main__":
    main(run, __doc__)
