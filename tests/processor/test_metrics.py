"""Processor metrics with several workers (prometheus_client multiprocess mode): whichever worker
is scraped reports every worker's requests, and the request log's text format."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import textwrap

from prometheus_client import multiprocess

from mmcache.processor import metrics as metrics_module
from mmcache.processor.metrics import ProcessorMetrics
from mmcache.processor.request_log import RequestRecord
from mmcache.scrape import Samples
from mmcache.shared.logs import TextFormatter

WORKER = textwrap.dedent(
    """
    import sys
    from mmcache.processor.metrics import ProcessorMetrics
    from mmcache.processor.request_log import RequestRecord

    hits, render = int(sys.argv[1]), sys.argv[2] == "render"
    m = ProcessorMetrics()
    record = RequestRecord(prompt_tokens=10, completion_tokens=4)
    record.e2e, record.first_token = 0.2, record.started + 0.05
    m.observe(record)
    stats = {
        "cache_hits": hits, "cache_misses": 1, "cache_evictions": 0, "decodes": 1, "file_reads": 0,
        "bytes_fetched": {"data": 1000, "file": 0, "http": 0}, "repairs": {"missing": 0},
        "failover_retries": {"llm": 0}, "failover_migrations": 0, "failover_exhausted": 0,
        "unprobed_routes": 0, "cache_bytes": 100, "cache_capacity_bytes": 1000, "cache_entries": 1,
    }
    m.sync(stats)
    m.sync(stats)  # a second sync of the same numbers adds nothing
    if render:
        sys.stdout.write(m.render().decode())
    """
)


def _worker(tmp_path, hits: int, render: bool) -> subprocess.CompletedProcess:
    env = {
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": ":".join(sys.path),
    }
    args = [sys.executable, "-c", WORKER, str(hits), "render" if render else "-"]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=120, check=True)


def test_any_worker_reports_every_workers_numbers(tmp_path, monkeypatch):
    first = _worker(tmp_path, hits=3, render=False)
    second = _worker(tmp_path, hits=5, render=True)
    assert first.stdout == ""
    s = Samples.parse(second.stdout)
    assert s.total("mmcache_processor_requests_total", status="200") == 2
    assert s.total("mmcache_processor_e2e_request_latency_seconds_count") == 2
    assert s.total("mmcache_processor_time_to_first_token_seconds_count") == 2
    assert s.total("mmcache_processor_prompt_tokens_total") == 20
    assert s.total("mmcache_processor_cache_hits_total") == 8
    assert s.total("mmcache_processor_media_bytes_fetched_total", source="data") == 2000
    assert s.total("mmcache_processor_cache_bytes") == 200  # each worker has a cache of its own
    assert all(t != "unknown" for t in s.types.values())
    # A worker that exits is taken out of the live gauges (what a supervisor of --workers calls).
    pid = int(next(p for p in tmp_path.glob("gauge_livesum_*.db")).stem.rsplit("_", 1)[1])
    multiprocess.mark_process_dead(pid, str(tmp_path))
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    after = Samples.parse(ProcessorMetrics().render().decode())
    assert after.total("mmcache_processor_cache_bytes") == 100
    assert after.total("mmcache_processor_requests_total") == 2  # counters keep what dead workers did


STATS = {
    "cache_hits": 2,
    "cache_misses": 1,
    "cache_evictions": 0,
    "decodes": 1,
    "file_reads": 0,
    "bytes_fetched": {"data": 10},
    "repairs": {"missing": 1},
    "failover_retries": {"llm": 0, "encoder": 0},
    "failover_migrations": 0,
    "failover_exhausted": 0,
    "unprobed_routes": 0,
    "cache_bytes": 5,
    "cache_capacity_bytes": 50,
    "cache_entries": 1,
}


def test_sync_advances_counters_by_the_difference_only():
    m = ProcessorMetrics()
    m.sync(STATS)
    m.sync({**STATS, "cache_hits": 7, "repairs": {"missing": 3}})
    s = Samples.parse(m.render().decode())
    assert s.total("mmcache_processor_cache_hits_total") == 7
    assert s.total("mmcache_processor_repairs_total", cause="missing") == 3
    assert s.total("mmcache_processor_cache_capacity_bytes") == 50


async def test_a_worker_of_several_syncs_after_requests_at_most_once_per_interval(monkeypatch, tmp_path):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(metrics_module, "SYNC_SECONDS", 0.2)
    m = ProcessorMetrics()
    calls: list[int] = []

    def stats():
        calls.append(1)
        return {**STATS, "cache_hits": len(calls)}

    m.request_done(stats)
    assert len(calls) == 1  # the first request syncs at once
    m.request_done(stats)
    m.request_done(stats)
    assert len(calls) == 1  # the next ones within the interval wait ...
    await asyncio.sleep(0.4)
    assert len(calls) == 2  # ... for one deferred sync, which does come


def test_text_log_lines_carry_the_fields_as_key_value_pairs():
    record = RequestRecord(prompt_tokens=12, cached_tokens=8, completion_tokens=3)
    record.set_salt("secret")
    record.mm_cache = {"processor_hits": 1}
    line = TextFormatter("%(levelname)s %(message)s").format(
        logging.makeLogRecord({"levelname": "INFO", "msg": "request", **record.fields()})
    )
    assert line.startswith("INFO request request_id=chatcmpl-")
    assert "prompt_tokens=12 cached_tokens=8 completion_tokens=3" in line
    assert "mm_cache=processor_hits:1" in line and "status=200" in line
    assert "secret" not in line and f"salt_hash={record.salt_hash}" in line
    json.dumps(record.fields())  # the JSON log takes the same fields
