"""The shared KV tier end to end: ``mmcache serve --kv-store redis://...`` against a real
redis-server. A replica that never saw a prompt (a second server on the same store, as after a
restart or a failover) gets its prefix from the store: ``cached_tokens`` covers it, and its greedy
tokens and prompt logprobs equal ``--no-cache``'s, for text, an image, a video and a multi-turn
conversation. /health and /metrics show the store; ``--kv-store-server`` runs one of its own."""

from __future__ import annotations

import time

import pytest

from mmcache.kv_store_server import RedisServer
from tests.e2e.server import serving
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
