"""The shared KV tier end to end: ``mmcache serve --kv-store redis://...`` against a real
redis-server. A replica that never saw a prompt (a second server on the same store, as after a
restart or a failover) gets its prefix from the store: ``cached_tokens`` covers it, and its greedy
tokens and prompt logprobs equal ``--no-cache``'s, for text, an image, a video and a multi-turn
conversation. /health and /metrics show the store; ``--kv-store-server`` runs one of its own."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from mmcache.kv_store_server import RedisServer
from tests.e2e.server import free_port, serving, stage_env, wait_healthy
from tests.e2e.test_prompt_logprobs import CASES, body, same
from tests.e2e.util import ok

pytestmark = pytest.mark.e2e

KINDS = ["text", "one_image", "video", "multi_turn"]


@pytest.fixture(scope="module")
def store():
    server = RedisServer().start()
    yield server
    server.stop()


def llm_counters(server) -> dict:
    _, health = server.get("/health")
    return next(s for s in health["stages"] if s["stage"] == "llm")["counters"]


def settled(server) -> dict:
    """The LLM replica's counters once its KV writer has caught up (nothing moved in 0.2 s)."""
    before = None
    for _ in range(50):
        now = llm_counters(server)
        done = now["kv_store_written_blocks"] + now["kv_store_dropped_blocks"]
        if done == before:
            return now
        before = done
        time.sleep(0.2)
    raise AssertionError("the KV writer did not settle")


def cached(out: dict) -> int:
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_fresh_replica_reads_prefixes_from_the_store(tiny_model, store, baseline) -> None:
    """Replica A computes every prompt (writing its blocks); replica B, started afterwards on the
    same store, answers them from it."""
    flags = ("--kv-store", store.url)
    with serving(tiny_model, *flags) as a:
        for kind in KINDS:
            ok(a, body(a, CASES[kind]()))
        counters = settled(a)
        assert counters["kv_store_enabled"] == 1 and counters["kv_store_up"] == 1
        assert counters["kv_store_written_blocks"] > 0 and counters["kv_store_dropped_blocks"] == 0
    with serving(tiny_model, *flags) as b:
        for kind in KINDS:
            messages = CASES[kind]()
            got = ok(b, body(b, messages))
            want = ok(baseline, body(baseline, messages))
            same(got, want)
            assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"], kind
            prompt = len(got["prompt_token_ids"])
            assert cached(got) >= (prompt - 1) // 16 * 16 - 16, (kind, cached(got), prompt)
            assert cached(got) > 0
            if kind != "text":  # the probe reported the store's prefix: its media was not encoded
                assert got["usage"]["mm_cache"]["prefix_skipped"] >= 1, kind
        samples = b.metrics().by_name()
        assert samples["mmcache_llm_kv_store_hits_total"] > 0
        assert samples["mmcache_llm_kv_store_errors_total"] == 0
        assert samples["mmcache_llm_kv_store_read_seconds_count"] > 0


def test_store_killed_serves_by_computing(tiny_model, store, baseline) -> None:
    messages = [{"role": "user", "content": "A story about the lighthouse keeper and the storm, please."}]
    victim = RedisServer().start()
    with serving(tiny_model, "--kv-store", victim.url) as srv:
        victim.kill()
        got = ok(srv, body(srv, messages))
        same(got, ok(baseline, body(baseline, messages)))
        samples = srv.metrics().by_name()
        assert samples["mmcache_llm_kv_store_errors_total"] >= 1
        assert samples["mmcache_llm_kv_store_up"] == 0


def test_serve_runs_its_own_store(tiny_model) -> None:
    with serving(tiny_model, "--kv-store-server", "--kv-store-server-mb", "64") as srv:
        messages = CASES["one_image"]()
        ok(srv, body(srv, messages))
        counters = settled(srv)
        assert counters["kv_store_enabled"] == 1 and counters["kv_store_up"] == 1
        assert counters["kv_store_written_blocks"] > 0
        assert len(srv.children) >= 4  # processor, encoder, llm and the store


def test_next_turn_on_another_replica_hits_the_store(tiny_model, store, baseline) -> None:
    """One processor, two LLM replicas on one store (each stage its own process, as compose runs
    them): the replica that served turn 1 is killed, so turn 2 lands on the other one, which
    reads turn 1's prefix from the store."""
    env = stage_env()
    base = [sys.executable, "-m", "mmcache"]
    encoder = f"tcp://127.0.0.1:{free_port()}"
    llms = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    port = free_port()
    cmds = [[*base, "encoder", "--model", str(tiny_model), "--bind", encoder]]
    cmds += [[*base, "llm", "--model", str(tiny_model), "--bind", a, "--kv-store", store.url] for a in llms]
    cmds.append(
        [
            *base,
            "processor",
            "--model",
            str(tiny_model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--encoder",
            encoder,
            "--llm",
            ",".join(llms),
        ]
    )
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for c in cmds]
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, procs)
        model = tiny_model.name
        turn1 = CASES["one_image"]()
        first = _post(url, {**body_for(model, turn1)})
        served = [
            s for s in _health(url)["stages"] if s["stage"] == "llm" and s["counters"]["prefix_queries"] > 0
        ]
        assert len(served) == 1
        victim = procs[1 + llms.index(served[0]["address"])]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # its writer stores turn 1's blocks within milliseconds
            if served[0]["counters"]["kv_store_written_blocks"] > 0:
                break
            time.sleep(0.2)
            served = [s for s in _health(url)["stages"] if s["address"] == served[0]["address"]]
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        turn2 = [*turn1, {"role": "assistant", "content": first["choices"][0]["message"]["content"]}]
        turn2.append({"role": "user", "content": "And what else?"})
        got = _post(url, body_for(model, turn2))
        want = ok(baseline, body_for(model, turn2))
        assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
        assert cached(got) >= (len(first["prompt_token_ids"]) - 1) // 16 * 16  # turn 1 came from the store
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def body_for(model: str, messages: list[dict]) -> dict:
    return {"model": model, "messages": messages, "max_tokens": 6, "temperature": 0, "return_token_ids": True}


def _post(url: str, payload: dict) -> dict:
    req = urllib.request.Request(
        url + "/v1/chat/completions", json.dumps(payload).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _health(url: str) -> dict:
    try:
        with urllib.request.urlopen(url + "/health", timeout=30) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return json.loads(err.read())
