"""Send a workload to one deployment: streamed requests at a fixed concurrency or a Poisson
request rate, a tqdm progress bar, one :class:`Outcome` per request, and the deployment's
``/metrics`` before and after (when it is an mmcache deployment)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field

import aiohttp
import numpy as np
from tqdm import tqdm

from mmcache.loadgen.workloads import Conversation, Options, body, conversations
from mmcache.scrape import Samples, scrape_deployment


@dataclass
class Outcome:
    """One request as the client saw it (seconds from the start of the run)."""

    start: float
    status: int = 0
    error: str | None = None
    ttft: float | None = None
    end: float = 0.0
    token_times: list[float] = field(default_factory=list)  # when each content chunk arrived
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def latency(self) -> float:
        return self.end - self.start

    def as_dict(self) -> dict:
        out = asdict(self)
        out.pop("token_times")
        return out


@dataclass
class Run:
    url: str
    model: str
    options: Options
    concurrency: int | None
    request_rate: float | None
    duration: float
    outcomes: list[Outcome]
    metrics_before: Samples | None
    metrics_after: Samples | None


async def model_name(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/v1/models") as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


async def _one(session: aiohttp.ClientSession, url: str, payload: bytes, t0: float) -> tuple[Outcome, str]:
    """One streamed request; returns its outcome and the answer's text."""
    out = Outcome(start=time.perf_counter() - t0)
    text: list[str] = []
    try:
        async with session.post(
            url + "/v1/chat/completions", data=payload, headers={"Content-Type": "application/json"}
        ) as resp:
            out.status = resp.status
            if resp.status != 200:
                out.error = (await resp.text())[:500]
            else:
                await _read_stream(resp, out, text, t0)
    except (aiohttp.ClientError, TimeoutError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    out.end = time.perf_counter() - t0
    return out, "".join(text)


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[dict]:
    """The JSON events of a streamed chat completion, as they arrive (``[DONE]`` is not one)."""
    async for raw in resp.content:
        line = raw.strip()
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            yield json.loads(line[6:])


async def _read_stream(resp: aiohttp.ClientResponse, out: Outcome, text: list[str], t0: float) -> None:
    async for event in sse_events(resp):
        if "error" in event:
            out.error = str(event["error"].get("message"))
            return
        for choice in event.get("choices", []):
            content = (choice.get("delta") or {}).get("content")
            if content:
                now = time.perf_counter() - t0
                out.ttft = out.ttft if out.ttft is not None else now - out.start
                out.token_times.append(now)
                text.append(content)
        usage = event.get("usage")
        if usage:
            out.prompt_tokens = usage.get("prompt_tokens", 0)
            out.completion_tokens = usage.get("completion_tokens", 0)
            out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def _scrape(url: str) -> Samples | None:
    """The deployment's metrics, or None when it has none that mmcache can read."""
    with contextlib.suppress(Exception):
        return scrape_deployment(url)
    return None


async def run(
    url: str,
    opt: Options,
    concurrency: int | None = None,
    request_rate: float | None = None,
    model: str | None = None,
    timeout: float = 600.0,
    progress: bool = True,
) -> Run:
    """Send every conversation of ``opt`` to ``url``: at most ``concurrency`` at a time, or
    starting at ``request_rate`` per second (Poisson arrivals); at least one of them is given."""
    url = url.rstrip("/")
    convs = conversations(opt)
    limit = asyncio.Semaphore(concurrency or len(convs))
    rng = np.random.default_rng(opt.seed + 1)
    session_timeout = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(
        timeout=session_timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        model = model or await model_name(session, url)
        before = await asyncio.to_thread(_scrape, url)
        bar = tqdm(total=sum(len(c.turns) for c in convs), desc=url, unit="req", disable=not progress)
        outcomes: list[Outcome] = []
        t0 = time.perf_counter()

        async def converse(conv: Conversation, delay: float) -> None:
            await asyncio.sleep(delay)
            async with limit:
                answers: list[str] = []
                for turn in conv.turns:
                    payload = json.dumps(body(model, turn(answers), opt.max_tokens)).encode()
                    outcome, answer = await _one(session, url, payload, t0)
                    outcomes.append(outcome)
                    answers.append(answer)
                    bar.update()
                    if not outcome.ok:
                        break

        delays = np.zeros(len(convs))
        if request_rate:
            delays = np.cumsum(rng.exponential(1.0 / request_rate, len(convs)))
        await asyncio.gather(*(converse(c, float(d)) for c, d in zip(convs, delays, strict=True)))
        duration = time.perf_counter() - t0
        bar.close()
        after = await asyncio.to_thread(_scrape, url)
    outcomes.sort(key=lambda o: o.start)
    return Run(url, model, opt, concurrency, request_rate, duration, outcomes, before, after)
