"""Every stage's own /metrics: counters move by exactly what a request did, each latency
histogram by one observation per request; the text passes ``promtool check metrics`` and
prometheus_client's parser types every family; the processor logs one line per request
(never the salt); the Grafana dashboard queries only metrics that exist."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from pathlib import Path

import pytest
import torch
import xxhash
import zmq
from prometheus_client.parser import text_string_to_metric_families

from mmcache.scrape import Samples, endpoints, fetch_text, scrape_endpoints
from mmcache.shared.messages import ErrorReply, GenerateRequest, SamplingParams
from mmcache.shared.rpc import RemoteError, RpcClient
from tests.e2e.server import serving
from tests.e2e.util import image_part
from tests.media import image_bytes
from tests.promtool import check_metrics

pytestmark = pytest.mark.e2e

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "mmcache.json"
SALT = "tenant-secret-7f3a"


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("metrics") / "serve.log"
    with serving(tiny_model, "--log-format", "json", log=log, env={"MMCACHE_LOG_LEVEL": "INFO"}) as srv:
        yield srv


def scrape_stages(server) -> dict[str, Samples]:
    """processor / encoder / llm → that endpoint's samples (one replica each here)."""
    return {ep.stage: samples for ep, samples in scrape_endpoints(endpoints(server.url))}


def stream(server, body: dict) -> tuple[str, dict]:
    """A streamed completion: its text and its usage."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(
        server.url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    text, usage = [], {}
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            text += [c["delta"].get("content") or "" for c in event["choices"]]
            usage = event.get("usage") or usage
    return "".join(text), usage


def image_request(server, img: bytes, system: str) -> dict:
    return {
        "model": server.model_name(),
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": [image_part(img), {"type": "text", "text": "What is it?"}]},
        ],
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "cache_salt": SALT,
    }


def delta(after: dict[str, Samples], before: dict[str, Samples], stage: str, name: str, **labels) -> float:
    return after[stage].total(name, **labels) - before[stage].total(name, **labels)


LATENCIES = {  # histograms observed once per request that reaches the LLM stage
    "processor": [
        "mmcache_processor_e2e_request_latency_seconds",
        "mmcache_processor_time_to_first_token_seconds",
    ],
    "llm": [
        "mmcache_llm_time_to_first_token_seconds",
        "mmcache_llm_e2e_request_latency_seconds",
        "mmcache_llm_request_queue_time_seconds",
        "mmcache_llm_request_prefill_time_seconds",
    ],
}


def test_a_repeated_image_moves_every_counter_by_its_exact_amount(server):
    img = image_bytes(448, 448, seed=41)
    first, _ = stream(server, image_request(server, img, "First system prompt."))
    before = scrape_stages(server)
    # Another system prompt: the prefix cache cannot cover the image, so the encoder tier answers.
    text, usage = stream(server, image_request(server, img, "Second system prompt."))
    after = scrape_stages(server)
    assert usage["mm_cache"]["processor_hits"] == 1 and usage["mm_cache"]["encoder_hits"] == 1
    moved = {
        ("processor", "mmcache_processor_cache_hits_total"): 1,
        ("processor", "mmcache_processor_cache_misses_total"): 0,
        ("processor", "mmcache_processor_media_decodes_total"): 0,
        ("processor", "mmcache_processor_prompt_tokens_total"): usage["prompt_tokens"],
        ("processor", "mmcache_processor_cached_prompt_tokens_total"): usage["prompt_tokens_details"][
            "cached_tokens"
        ],
        ("processor", "mmcache_processor_completion_tokens_total"): 6,
        ("encoder", "mmcache_encoder_cache_hits_total"): 1,
        ("encoder", "mmcache_encoder_cache_misses_total"): 0,
        ("encoder", "mmcache_encoder_forwards_total"): 0,
        ("encoder", "mmcache_encoder_forward_seconds_count"): 0,
        ("encoder", "mmcache_encoder_fetches_total"): 1,
        ("llm", "mmcache_llm_prefix_cache_queries_total"): usage["prompt_tokens"],
        ("llm", "mmcache_llm_prefix_cache_hits_total"): usage["prompt_tokens_details"]["cached_tokens"],
        ("llm", "mmcache_llm_embedding_fetches_total"): 1,
        ("llm", "mmcache_llm_embedding_fetch_seconds_count"): 1,
        ("llm", "mmcache_llm_generation_tokens_total"): 6,
        ("llm", "mmcache_llm_inter_token_latency_seconds_count"): 5,  # one per token after the first
    }
    got = {key: delta(after, before, *key) for key in moved}
    assert got == moved
    steps = delta(after, before, "llm", "mmcache_llm_engine_steps_total")
    assert steps > 0 and delta(after, before, "llm", "mmcache_llm_engine_step_seconds_count") == steps
    assert delta(after, before, "processor", "mmcache_processor_requests_total", status="200", code="") == 1
    for stage, names in LATENCIES.items():
        for name in names:
            assert delta(after, before, stage, name + "_count") == 1, name
            assert delta(after, before, stage, name + "_sum") > 0, name
    # The same request again: a full prefix hit, no encoder lookup, no rows pulled; same answer.
    again, usage2 = stream(server, image_request(server, img, "Second system prompt."))
    third = scrape_stages(server)
    assert again == text and first  # the cached answer is the answer
    assert usage2["mm_cache"]["prefix_skipped"] == 1
    assert delta(third, after, "encoder", "mmcache_encoder_cache_hits_total") == 0
    assert delta(third, after, "llm", "mmcache_llm_embedding_fetch_seconds_count") == 0
    assert delta(third, after, "llm", "mmcache_llm_chunks_skipped_total") == 1
    for stage, names in LATENCIES.items():
        for name in names:
            assert delta(third, after, stage, name + "_count") == 1, name


def test_errors_are_counted_by_status_and_code(server):
    before = scrape_stages(server)
    status, reply = server.post("/v1/chat/completions", {"model": "nope", "messages": []})
    after = scrape_stages(server)
    code = reply["error"]["code"]
    assert 400 <= status < 500 and code
    labels = {"status": str(status), "code": code}
    assert delta(after, before, "processor", "mmcache_processor_requests_total", **labels) == 1
    assert delta(after, before, "processor", "mmcache_processor_e2e_request_latency_seconds_count") == 1
    assert delta(after, before, "llm", "mmcache_llm_e2e_request_latency_seconds_count") == 0


async def _bad_generate(address: str) -> ErrorReply:
    """A generate request the LLM replica must refuse (a token id outside the vocabulary), sent to
    it over ZeroMQ as the processor would (the processor never sends one: it tokenizes itself)."""
    ctx = zmq.Context()
    client = RpcClient(ctx, address, "llm")
    request = GenerateRequest(
        torch.tensor([1 << 30], dtype=torch.int32), [], [], [], SamplingParams(max_tokens=4)
    )
    try:
        async with client.stream(request, timeout=30) as replies:
            return await anext(aiter(replies))
    except RemoteError as exc:
        return exc.reply
    finally:
        client.close()
        ctx.destroy(linger=0)


def test_llm_stage_counts_error_replies_by_status_and_code(server):
    llm = next(ep for ep in endpoints(server.url) if ep.stage == "llm")
    before = scrape_stages(server)
    error = asyncio.run(_bad_generate(llm.address))
    after = scrape_stages(server)
    assert isinstance(error, ErrorReply) and (error.status, error.code) == (400, "bad_prompt")
    labels = {"status": "400", "code": "bad_prompt"}
    assert delta(after, before, "llm", "mmcache_llm_request_errors_total", **labels) == 1
    assert delta(after, before, "llm", "mmcache_llm_request_errors_total") == 1
    assert delta(after, before, "llm", "mmcache_llm_requests_total") == 0  # never reached the engine


def test_every_endpoint_passes_promtool_and_is_fully_typed(server):
    stream(server, image_request(server, image_bytes(224, 224, seed=42), "Lint me."))
    eps = endpoints(server.url)
    assert sorted(ep.stage for ep in eps) == ["encoder", "llm", "processor"]
    for ep in eps:
        text = fetch_text(ep.url)
        assert check_metrics(text) == "", ep
        families = list(text_string_to_metric_families(text))
        assert families, ep
        untyped = [f.name for f in families if f.type in ("unknown", "untyped")]
        assert untyped == [], ep
        assert all(f.name.startswith("mmcache_") for f in families), ep


def test_health_lists_each_replica_with_its_metrics_url(server):
    status, health = server.get("/health")
    assert status == 200
    assert health["metrics_url"].endswith("/metrics")
    for replica in health["stages"]:
        assert replica["metrics_url"].startswith("http://127.0.0.1:"), replica
        assert f"mmcache_{replica['stage']}_" in fetch_text(replica["metrics_url"])


def test_one_log_line_per_request_names_the_salt_only_by_its_hash(server):
    body = image_request(server, image_bytes(224, 224, seed=43), "Log me.")
    _, usage = stream(server, body)
    status, _ = server.post("/v1/chat/completions", {**body, "model": "nope"})
    assert status == 404
    raw = server.log_path.read_text()
    assert SALT not in raw
    lines = [json.loads(line) for line in raw.splitlines() if line.startswith("{")]
    requests = [r for r in lines if r.get("logger") == "mmcache.request"]
    ok, missing = requests[-2], requests[-1]
    assert ok["level"] == "INFO" and ok["stage"] == "processor"
    assert ok["status"] == 200 and ok["code"] is None and ok["stream"] is True
    assert ok["salt_hash"] == xxhash.xxh3_64_hexdigest(SALT.encode())
    assert ok["prompt_tokens"] == usage["prompt_tokens"]
    assert ok["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert ok["completion_tokens"] == 6
    assert ok["mm_cache"] == usage["mm_cache"]
    assert 0 < ok["ttft_s"] <= ok["e2e_s"]
    assert ok["request_id"].startswith("chatcmpl-")
    assert missing["status"] == 404 and missing["code"] == "model_not_found"


def test_the_dashboard_queries_only_metrics_that_exist(server):
    stream(server, image_request(server, image_bytes(224, 224, seed=44), "Dashboard."))
    exposed = set()
    for samples in scrape_stages(server).values():
        exposed |= samples.names()
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 20
    used = {name for e in exprs for name in re.findall(r"\bmmcache_[a-z0-9_]+", e)}
    assert used - exposed == set()
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in (
        "time to first token",
        "inter-token",
        "throughput",
        "hit rate",
        "kv cache",
        "cache occupancy",
    ):
        assert topic in titles
