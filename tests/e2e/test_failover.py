"""Kill tests: two encoder replicas, two LLM replicas and one processor, each its own process on
loopback, serving 24 concurrent streaming image requests; one replica is lost mid-load, either
SIGKILLed (its kernel closes the connections at once) or SIGSTOPped (hung: the connections stay
open and nothing answers, as when a node is cut off the network; the ZMTP heartbeat notices).

Every request must still succeed with the answer of an uninterrupted run (greedy, and seeded
sampling too): a lost encoder's chunks are encoded again at the next owner, a lost LLM replica's
streams move to the other one with their tokens so far, and the client's stream loses and
repeats nothing. The uninterrupted answers come from the same stack under another
``cache_salt`` (no cache tier shares anything across salts, and a salt never changes an answer).
"""

from __future__ import annotations

import asyncio
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import zmq

from mmcache.shared.messages import Ping
from mmcache.shared.rpc import RpcClient
from tests.e2e.streams import (
    KillWindow,
    Started,
    check_unchanged,
    failover_counters,
    failover_delta,
    run_all,
    stream,
    stream_bodies,
)
from tests.e2e.test_replicas import Stack

pytestmark = pytest.mark.e2e

CONCURRENT = 24
MAX_TOKENS = 96  # long enough that every stream is still going when the replica is killed


def bodies(salt: str, offset: int, side: int = 160, plain: bool = False) -> list[dict]:
    return stream_bodies("qwen2-vl", salt, offset, CONCURRENT, MAX_TOKENS, side, plain)


def run(stack: Stack, load: list[dict], kill=None, after: int = 0, at: int = 1):
    return run_all("127.0.0.1", stack.port, load, kill, after, at)


def llm_loads(addresses: list[str]) -> list[int]:
    """Each LLM replica's requests in progress, asked directly (the processor's /metrics pings
    every replica, a dead encoder's for up to a ping timeout: too slow for a kill's timing)."""

    async def ask() -> list[int]:
        ctx = zmq.Context()
        clients = [RpcClient(ctx, a, "llm") for a in addresses]
        try:
            return [p.load for p in await asyncio.gather(*(c.call(Ping(), timeout=5) for c in clients))]
        finally:
            for c in clients:
                c.close()
            ctx.destroy(linger=0)

    return asyncio.run(ask())


def counters(stack: Stack) -> dict[str, float]:
    return failover_counters(stack.url)


def check(name: str, stack: Stack, got, want, before: dict, killed_at: KillWindow) -> dict[str, int]:
    delta = failover_delta(stack.url, before)
    check_unchanged(name, got, want, delta, killed_at, MAX_TOKENS)
    return delta


LOSSES = {"killed": signal.SIGKILL, "hung": signal.SIGSTOP}


@pytest.fixture(scope="module", params=list(LOSSES))
def loss(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def stack(tiny_model, loss):
    s = Stack(tiny_model, encoders=2, llms=2, processors=2)
    yield s
    for p in s.procs:  # NOTE: a stopped process handles SIGTERM only once it runs again
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
    s.stop()


_lost: set[int] = set()  # pids of the replicas lost so far (a stopped one still "runs")


def lose(proc, loss: str) -> None:
    _lost.add(proc.pid)
    proc.send_signal(LOSSES[loss])
    if loss == "killed":
        proc.wait(timeout=10)


def test_encoder_lost_mid_load_fails_nothing(stack, loss):
    want, _ = run(stack, bodies("uninterrupted-enc", 500, side=336))
    before = counters(stack)
    encoder = stack.procs[0]
    # NOTE: the encoder is frozen (SIGSTOP) just before the load is sent, so the requests whose
    # chunks it owns (about half of 24 distinct images) are placed there and wait on it (until the
    # heartbeat drops it, ~1 s; placing takes milliseconds): the loss hits work in flight. Lost
    # only as the first stream started, it could find its encodes all done (0 encoder retries,
    # 0 repairs). As the first stream starts it is killed (or left hung); whichever of the
    # heartbeat and the closed connection notices first, its requests are encoded at the next
    # owner.
    load = bodies(f"{loss}-enc", 500, side=336)  # made first: the freeze must precede only the sending
    _lost.add(encoder.pid)
    encoder.send_signal(signal.SIGSTOP)
    got, killed_at = run(stack, load, lambda: lose(encoder, loss), after=1)
    delta = check(f"encoder {loss}", stack, got, want, before, killed_at)
    # the frozen encoder held requests in flight: encoded again at the next owner, or repaired
    assert delta["encoder_retried"] + delta["repairs"] > 0, delta
    # new requests after the kill: encoded at the survivor, no error
    again, _ = run(stack, bodies("after-enc", 700))
    assert all(g.error is None and g.completion_tokens == MAX_TOKENS for g in again)


def test_llm_lost_mid_stream_migrates_streams(stack, loss):
    """Streamed and not: every request the lost replica was generating moves with its tokens so
    far (a request nobody reads token by token still reports them every 16 tokens)."""
    want, _ = run(stack, bodies("uninterrupted-llm", 900, plain=True))
    before = counters(stack)
    load, killed = [], []

    def kill() -> None:
        """Lose the LLM replica running the most of these requests (LLM procs follow encoders')."""
        load.extend(llm_loads(stack.llms))
        print(f"\nLLM replicas' load at the loss: {load}")
        killed.append(stack.procs[len(stack.encoders) + load.index(max(load))])
        lose(killed[0], loss)

    # NOTE: lost once every stream has 24 tokens: the requests that are not streamed, sent and
    # decoded with them, have reported 16 by then, so every request moves mid-answer.
    load_ = bodies(f"{loss}-llm", 900, plain=True)
    streams = sum(b["stream"] for b in load_)
    got, killed_at = run(stack, load_, kill, after=streams, at=24)
    delta = check(f"LLM replica {loss}", stack, got, want, before, killed_at)
    assert delta["migrated"] == max(load) and delta["retried"] == 0, (delta, load)
    assert delta["exhausted"] == 0


def test_processor_lost_the_other_serves(stack, loss):
    """Two processors share the stages; the second is lost mid-load. Every request at the first
    succeeds with the uninterrupted answer, and the LLM replicas stop the lost processor's
    generations at once (its connections close, or their heartbeat closes them) instead of
    running them to their (long) max_tokens. Its own clients lose their HTTP connections."""
    survivor, lost = stack.procs[-2:]
    want, _ = run(stack, bodies("uninterrupted-proc", 1300)[::2])
    load = bodies(f"{loss}-proc", 1300)
    kept, doomed = load[::2], load[1::2]
    for body in doomed:
        body["max_tokens"] = 2000  # ~a minute of decoding if nothing stops it
    before = counters(stack)
    started = Started()
    with ThreadPoolExecutor(len(load)) as pool:
        futures = [pool.submit(stream, "127.0.0.1", stack.ports[0], b, started) for b in kept]
        orphans = [pool.submit(stream, "127.0.0.1", stack.ports[1], b, started, 1, 10) for b in doomed]
        started.wait(len(load), timeout=120)
        killed_at = time.monotonic()
        lose(lost, loss)
        window = KillWindow(killed_at, time.monotonic())
        got = [f.result() for f in futures]
        llm_procs = stack.procs[len(stack.encoders) : len(stack.encoders) + len(stack.llms)]
        live = [a for a, p in zip(stack.llms, llm_procs, strict=True) if p.pid not in _lost]
        while sum(llm_loads(live)) > 0:
            waited = time.monotonic() - killed_at
            assert waited < 20, f"the lost processor's generations still run after {waited:.0f} s"
            time.sleep(0.2)
        idle = time.monotonic() - killed_at
        # NOTE: a killed server's stream may just end (the connection closed between events)
        cut = sum(f.result().completion_tokens != doomed[0]["max_tokens"] for f in orphans)
    check(f"processor {loss} (at the other)", stack, got, want, before, window)
    print(f"its {len(doomed)} requests: {cut} cut off; the LLM replicas idle by {idle:.1f} s after the loss")
    assert cut == len(doomed)
    assert survivor.poll() is None


def test_no_encoder_left_ends_with_a_clear_error_soon(stack, loss):
    """Runs after the encoder loss test: the last encoder is lost too; a request with a new image
    then ends with a 503 naming why, in seconds, and counts as exhausted; one whose image the
    LLM replica's prefix cache holds needs no encoder and is served."""
    cached = bodies("no-encoder", 1500)[0]
    cached.update(stream=False, max_tokens=8)
    cached.pop("stream_options")
    assert stream("127.0.0.1", stack.port, cached, Started()).error is None
    for proc in stack.procs[: len(stack.encoders)]:
        if proc.pid not in _lost:
            lose(proc, loss)
    before = counters(stack)
    t0 = time.monotonic()
    got = stream("127.0.0.1", stack.port, bodies("no-encoder", 1600)[0], Started())
    elapsed = time.monotonic() - t0
    print(f"\nno encoder left: {got.error} after {elapsed:.2f} s")
    assert got.error is not None and "503" in got.error and "stage_unavailable" in got.error, got.error
    assert "no encoder replica could encode" in got.error
    assert elapsed < 15
    assert counters(stack)["exhausted"] == before["exhausted"] + 1
    again = stream("127.0.0.1", stack.port, cached, Started())
    assert again.error is None and again.completion_tokens == 8, again.error


def test_no_llm_replica_left_ends_with_a_clear_error_soon(stack, loss):
    """Runs after the LLM loss test: the last replica is lost too; a request then ends with a
    503 naming why, in seconds (not at the 120 s stage timeout), and counts as exhausted."""
    for proc in stack.procs[len(stack.encoders) : len(stack.encoders) + len(stack.llms)]:
        if proc.poll() is None:
            lose(proc, loss)
    before = counters(stack)
    t0 = time.monotonic()
    got = stream("127.0.0.1", stack.port, bodies("nothing-left", 1100)[0], Started())
    elapsed = time.monotonic() - t0
    print(f"\nno LLM replica left: {got.error} after {elapsed:.2f} s")
    assert got.error is not None and "503" in got.error and "stage_unavailable" in got.error, got.error
    assert "LLM replica" in got.error
    assert elapsed < 15
    assert counters(stack)["exhausted"] == before["exhausted"] + 1
