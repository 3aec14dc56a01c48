"""Concurrent streaming load for the kill tests (loopback processes, compose, Swarm): each stream's
text, completion token count and the time of each delta, the processor's failover counters, and
the check that a run with a kill in it answered exactly like an uninterrupted one."""

from __future__ import annotations

import http.client
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from mmcache.scrape import scrape
from tests.e2e.util import chat, image_part
from tests.media import image_bytes


@dataclass
class Streamed:
    text: str = ""
    completion_tokens: int = -1
    error: str | None = None
    arrivals: list[float] = field(default_factory=list)  # monotonic time of each content delta


def stream_bodies(
    model: str, salt: str, offset: int, count: int, max_tokens: int, side: int = 160, plain: bool = False
) -> list[dict]:
    """``count`` requests, each its own image (``side`` high, their widths vary around it); a
    third of them seeded sampling; ``plain``: every fourth is not streamed (the client waits for
    the whole answer). Every answer runs to ``max_tokens`` (``ignore_eos``), so the requests are
    still going at a kill."""
    out = []
    for i in range(count):
        img = image_bytes(side + 16 * (i % 4), side, seed=offset + i)
        extra = {"temperature": 0.8, "seed": 1000 + i} if i % 3 == 2 else {}
        body = chat(model, [image_part(img), {"type": "text", "text": f"Picture {i}?"}], **extra)
        streamed = not (plain and i % 4 == 3)
        body.update(max_tokens=max_tokens, ignore_eos=True, stream=streamed, cache_salt=salt)
        if streamed:
            body["stream_options"] = {"include_usage": True}
        out.append(body)
    return out


class Started:
    """How many streams have had their first tokens (or their ``at``-th)."""

    def __init__(self):
        self.count = 0
        self.cond = threading.Condition()

    def one(self) -> None:
        with self.cond:
            self.count += 1
            self.cond.notify_all()

    def wait(self, n: int, timeout: float) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.count >= n, timeout), (
                f"{self.count} of {n} streams started"
            )


def complete(host: str, port: int, body: dict, timeout: float = 120) -> Streamed:
    """POST a body that is not streamed; its answer."""
    out = Streamed()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        if resp.status != 200:
            out.error = f"HTTP {resp.status}: {raw[:300]!r}"
            return out
        answer = json.loads(raw)
        out.text = answer["choices"][0]["message"]["content"]
        out.completion_tokens = answer["usage"]["completion_tokens"]
    except Exception as exc:  # the test counts it as failed
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    return out


class HTTPFailed(Exception):
    """A completion answered with another status than 200."""


def sse_events(conn: http.client.HTTPConnection, body: dict) -> Iterator[dict]:
    """POST ``body`` (streamed) on ``conn``; its server-sent events as they come, ``[DONE]`` left
    out. Raises :class:`HTTPFailed` (``HTTP <status>: <body>``) for another status than 200."""
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise HTTPFailed(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    for raw in resp:
        line = raw.strip()
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            yield json.loads(line[6:])


def stream(host: str, port: int, body: dict, started: Started, at: int = 1, timeout: float = 120) -> Streamed:
    """POST ``body`` and read its server-sent events to the end; ``started`` hears of it once it
    has had ``at`` content deltas (or ended). A body that is not streamed is :func:`complete`d."""
    if not body["stream"]:
        return complete(host, port, body, timeout)
    out = Streamed()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    first = True
    try:
        for event in sse_events(conn, body):
            if "error" in event:
                out.error = json.dumps(event["error"])
            if event.get("usage"):
                out.completion_tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices", []):
                content = choice["delta"].get("content")
                if content:
                    out.text += content
                    out.arrivals.append(time.monotonic())
                    if first and len(out.arrivals) >= at:
                        first = False
                        started.one()
    except Exception as exc:  # the test counts it as failed
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
        if first:
            started.one()  # never leave the killer waiting on one that ended early
    return out


@dataclass(frozen=True)
class KillWindow:
    """From the call of a kill to its return (monotonic): a ``docker kill`` or a network cut
    lands somewhere inside, not at the call."""

    start: float = 0.0
    end: float = 0.0


def run_all(
    host: str,
    port: int,
    load: list[dict],
    kill: Callable[[], object] | None = None,
    after: int = 0,
    at: int = 1,
    start_timeout: float = 120,
    early: Callable[[], object] | None = None,
) -> tuple[list[Streamed], KillWindow]:
    """Every body at once; ``early()`` runs once the first stream has its first tokens (the others
    still being encoded or prefilled), ``kill()`` once ``after`` streams have had ``at`` tokens;
    the window runs from the first of them to the end of the last."""
    started = Started()
    with ThreadPoolExecutor(len(load)) as pool:
        futures = [pool.submit(stream, host, port, b, started, at) for b in load]
        window = KillWindow()
        start = None
        if early is not None:
            started.wait(1, timeout=start_timeout)
            start = time.monotonic()
            early()
        if kill is not None:
            started.wait(after, timeout=start_timeout)
            start = start or time.monotonic()
            kill()
        if start is not None:
            window = KillWindow(start, time.monotonic())
        return [f.result() for f in futures], window


def failover_counters(url: str) -> dict[str, float]:
    """The processor's failover counters (its own /metrics at ``url``)."""
    m = scrape(url + "/metrics")
    return {
        "retried": m.total("mmcache_processor_failover_retries_total", stage="llm"),
        "migrated": m.total("mmcache_processor_failover_migrations_total"),
        "encoder_retried": m.total("mmcache_processor_failover_retries_total", stage="encoder"),
        "repairs": m.total("mmcache_processor_repairs_total"),
        "exhausted": m.total("mmcache_processor_failover_exhausted_total"),
    }


def failover_delta(url: str, before: dict[str, float]) -> dict[str, int]:
    """How far each failover counter moved since ``before``."""
    after = failover_counters(url)
    return {k: int(after[k] - before[k]) for k in after}


def longest_gap(got: list[Streamed], kill: KillWindow) -> float:
    """The longest wait for a next token that spans the kill: what a moved stream lost."""
    return max(
        (
            b - a
            for g in got
            for a, b in itertools.pairwise(g.arrivals)
            if a <= kill.end + 0.05 and b >= kill.start
        ),
        default=0.0,
    )


def check_unchanged(
    name: str,
    got: list[Streamed],
    want: list[Streamed],
    delta: dict[str, int],
    kill: KillWindow,
    max_tokens: int,
) -> float:
    """Print sent / succeeded / retried / migrated / failed and the longest gap across the kill;
    assert that nothing failed and every answer (text and token count) is the uninterrupted one.
    Returns the longest gap in seconds."""
    failed = [g.error for g in got if g.error is not None]
    lost = longest_gap(got, kill)
    print(
        f"\n{name}: sent {len(got)} succeeded {len(got) - len(failed)} retried {delta['retried']} "
        f"migrated {delta['migrated']} encoder retries {delta['encoder_retried']} repairs {delta['repairs']} "
        f"failed {len(failed)}; longest gap across the kill {lost * 1000:.0f} ms"
    )
    assert not failed, failed[:3]
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert w.error is None and w.completion_tokens == max_tokens, (i, w.error)
        # no token lost or repeated: the same text and the same token count as uninterrupted
        assert (g.text, g.completion_tokens) == (w.text, w.completion_tokens), i
    return lost
