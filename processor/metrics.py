"""The processor's Prometheus metrics (``mmcache_processor_*``), served on its own ``/metrics``.

Numbers the components keep as plain ints (cache hits, evictions, ...) are copied into
counters by :meth:`ProcessorMetrics.sync` when this worker is scraped.

Multiprocess-safe: with ``PROMETHEUS_MULTIPROC_DIR`` set (several workers on one port), every
worker writes its values to files there and a scrape of any worker sums all of them
(prometheus_client's multiprocess mode). A worker that is not the one scraped must keep its
files current on its own: it syncs after a request, at most once per :data:`SYNC_SECONDS`
(a request in between is synced that long after).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Mapping
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from mmcache.processor.request_log import RequestRecord
from mmcache.shared.metrics import LATENCY_BUCKETS

# Gauges of one worker add up to the whole (each worker has its own cache); dead workers drop out.
_SUM: Final = "livesum"
SYNC_SECONDS = 1.0

StatsFn = Callable[[], Mapping[str, "float | Mapping[str, float]"]]


class ProcessorMetrics:
    def __init__(self) -> None:
        self.multiprocess_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "mmcache_processor_requests",
            "chat completion requests, by HTTP status and error code",
            ["status", "code"],
            registry=r,
        )
        self.running = Gauge(
            "mmcache_processor_requests_running", "requests in progress", registry=r, multiprocess_mode=_SUM
        )
        self.e2e = Histogram(
            "mmcache_processor_e2e_request_latency_seconds",
            "request received → response complete, as the client sees it",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "mmcache_processor_time_to_first_token_seconds",
            "request received → first content sent (streamed requests)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("mmcache_processor_prompt_tokens", "prompt tokens", registry=r)
        self.cached_tokens = Counter(
            "mmcache_processor_cached_prompt_tokens", "prompt tokens the prefix cache served", registry=r
        )
        self.completion_tokens = Counter(
            "mmcache_processor_completion_tokens", "tokens generated", registry=r
        )
        self._synced: dict[str, Counter | Gauge] = {
            "cache_hits": Counter(
                "mmcache_processor_cache_hits", "media found in the processor cache", registry=r
            ),
            "cache_misses": Counter("mmcache_processor_cache_misses", "media not in the cache", registry=r),
            "cache_evictions": Counter(
                "mmcache_processor_cache_evictions", "media layouts evicted", registry=r
            ),
            "decodes": Counter(
                "mmcache_processor_media_decodes", "media items decoded and resized", registry=r
            ),
            "file_reads": Counter("mmcache_processor_file_reads", "file:// media read from disk", registry=r),
            "bytes_fetched": Counter(
                "mmcache_processor_media_bytes_fetched",
                "media bytes obtained, by source",
                ["source"],
                registry=r,
            ),
            "repairs": Counter(
                "mmcache_processor_repairs", "media encoded again, by cause", ["cause"], registry=r
            ),
            "failover_retries": Counter(
                "mmcache_processor_failover_retries",
                "work sent again after a replica died, by stage",
                ["stage"],
                registry=r,
            ),
            "failover_migrations": Counter(
                "mmcache_processor_failover_migrations",
                "generations moved to another LLM replica mid-answer, with their tokens so far",
                registry=r,
            ),
            "failover_exhausted": Counter(
                "mmcache_processor_failover_exhausted",
                "requests that ended because every failover was used up",
                registry=r,
            ),
            "unprobed_routes": Counter(
                "mmcache_processor_unprobed_routes",
                "requests sent to the only LLM replica without a probe (a prompt without media)",
                registry=r,
            ),
            "cache_bytes": Gauge(
                "mmcache_processor_cache_bytes", "bytes held by the cache", registry=r, multiprocess_mode=_SUM
            ),
            "cache_capacity_bytes": Gauge(
                "mmcache_processor_cache_capacity_bytes", "cache capacity", registry=r, multiprocess_mode=_SUM
            ),
            "cache_entries": Gauge(
                "mmcache_processor_cache_entries", "media layouts cached", registry=r, multiprocess_mode=_SUM
            ),
        }
        self._last: dict[tuple[str, str | None], float] = {}
        self._next_sync = 0.0
        self._sync_pending: asyncio.TimerHandle | None = None

    def observe(self, record: RequestRecord) -> None:
        """One finished request."""
        self.requests.labels(str(record.status), record.code or "").inc()
        self.e2e.observe(record.e2e)
        if record.ttft is not None:
            self.ttft.observe(record.ttft)
        self.prompt_tokens.inc(record.prompt_tokens)
        self.cached_tokens.inc(record.cached_tokens)
        self.completion_tokens.inc(record.completion_tokens)

    def request_done(self, stats: StatsFn) -> None:
        """After a request (on the event loop): keep this worker's files current when several
        workers share them; a single worker syncs only when scraped."""
        if self.multiprocess_dir is None or self._sync_pending is not None:
            return
        wait = self._next_sync - time.monotonic()
        if wait <= 0:
            self._sync_now(stats)
        else:
            self._sync_pending = asyncio.get_running_loop().call_later(wait, self._sync_now, stats)

    def _sync_now(self, stats: StatsFn) -> None:
        self._sync_pending = None
        self._next_sync = time.monotonic() + SYNC_SECONDS
        self.sync(stats())

    def sync(self, stats: Mapping[str, float | Mapping[str, float]]) -> None:
        """Bring counters and gauges up to the components' ``stats()`` numbers."""
        for key, metric in self._synced.items():
            value = stats[key]
            if isinstance(value, Mapping):
                assert isinstance(metric, Counter), key  # numbers by label are counters here
                for label, v in value.items():
                    self._advance(metric.labels(label), (key, label), v)
            elif isinstance(metric, Gauge):
                metric.set(value)
            else:
                self._advance(metric, (key, None), value)

    def _advance(self, counter: Counter, key: tuple[str, str | None], value: float) -> None:
        delta = value - self._last.get(key, 0)
        if delta > 0:
            counter.inc(delta)
            self._last[key] = value

    def render(self) -> bytes:
        """The exposition text: this worker's registry, or every worker's files."""
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        MultiProcessCollector(merged, path=self.multiprocess_dir)
        return generate_latest(merged)
