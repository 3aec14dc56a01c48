"""The encoder stage's Prometheus metrics (``mmcache_encoder_*``), one registry per service."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram

from mmcache.shared.metrics import LATENCY_BUCKETS, Family, Stats, StatsCollector

FAMILIES = [
    Family("mmcache_encoder_forwards", "counter", "vision forwards run", "forwards"),
    Family(
        "mmcache_encoder_chunks_encoded",
        "counter",
        "chunks (images, video temporal patches) encoded",
        "chunks_encoded",
    ),
    Family("mmcache_encoder_patches", "counter", "vision patches encoded", "patches"),
    Family(
        "mmcache_encoder_cache_hits", "counter", "embedding cache lookups that found the chunk", "cache_hits"
    ),
    Family("mmcache_encoder_cache_misses", "counter", "embedding cache lookups that did not", "cache_misses"),
    Family(
        "mmcache_encoder_cache_evictions", "counter", "embeddings evicted from the cache", "cache_evictions"
    ),
    Family("mmcache_encoder_cache_entries", "gauge", "embeddings in the cache", "cache_entries"),
    Family("mmcache_encoder_cache_bytes", "gauge", "bytes of embeddings in the cache", "cache_bytes"),
    Family(
        "mmcache_encoder_cache_capacity_bytes", "gauge", "embedding cache capacity", "cache_capacity_bytes"
    ),
    Family("mmcache_encoder_fetches", "counter", "embedding row reads served to LLM stages", "fetches"),
    Family("mmcache_encoder_queue_chunks", "gauge", "chunks waiting for a vision forward", "queued"),
]

# Chunks in one forward: 1 up to a few dozen small images under the default patch budget.
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
PATCH_BUCKETS = (64, 256, 512, 1024, 2048, 4096, 8192, 16384)


class EncoderMetrics:
    def __init__(self, stats: Callable[[], Stats]):
        self.registry = CollectorRegistry()
        self.registry.register(StatsCollector(stats, FAMILIES))
        r = self.registry
        self.forward_seconds = Histogram(
            "mmcache_encoder_forward_seconds",
            "time of one vision forward (a batch)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_chunks = Histogram(
            "mmcache_encoder_batch_chunks", "chunks per vision forward", buckets=BATCH_BUCKETS, registry=r
        )
        self.batch_patches = Histogram(
            "mmcache_encoder_batch_patches", "patches per vision forward", buckets=PATCH_BUCKETS, registry=r
        )

    def forward(self, num_chunks: int, num_patches: int, seconds: float) -> None:
        """One vision forward ran (the batcher calls this)."""
        self.forward_seconds.observe(seconds)
        self.batch_chunks.observe(num_chunks)
        self.batch_patches.observe(num_patches)
