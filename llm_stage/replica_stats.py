"""The numbers an LLM stage replica reports (its heartbeat's counters, its Prometheus metrics):
prefix-cache queries and hits, KV blocks in use, requests running and waiting, embedding rows
fetched, grammar compiles, memory, and the shared KV tier's counters. Read by the metrics
thread too, so it takes ints and lengths only."""

from __future__ import annotations

from typing import Any

from mmcache.llm_stage.engine import Engine
from mmcache.llm_stage.grammar import GrammarStats
from mmcache.llm_stage.kv_tier import KVTier
from mmcache.llm_stage.media_fetch import FetchStats
from mmcache.llm_stage.sequence import SeqStatus

# the keys read from the KV tier's counters (``kv_store_<KVTierStats field>``)
KV_TIER_COUNTERS = (
    "kv_store_lookups",
    "kv_store_skipped",
    "kv_store_hit_blocks",
    "kv_store_miss_blocks",
    "kv_store_loaded_blocks",
    "kv_store_bytes_in",
    "kv_store_bytes_out",
    "kv_store_written_blocks",
    "kv_store_dropped_blocks",
)


def replica_stats(
    engine: Engine, fetch: FetchStats, grammars: GrammarStats, healthy: bool, block_bytes: int
) -> dict[str, int | float]:
    """``engine``'s numbers, with its embedding fetches ``fetch`` and grammar cache ``grammars``;
    ``block_bytes``: one KV block's bytes."""
    blocks, scheduler = engine.blocks, engine.scheduler
    total = len(blocks.blocks)
    used = total - blocks.num_free_blocks
    running = sum(1 for seq in scheduler.running if seq.status is SeqStatus.RUNNING)
    return {
        "prefix_queries": blocks.stats.queries,
        "prefix_hits": blocks.stats.hits,
        "evictions": blocks.stats.evictions,
        "preemptions": scheduler.num_preemptions,
        "steps": engine.num_steps,
        "step_failures": engine.num_step_failures,
        "healthy": int(healthy),
        "pins": len(blocks.pins),
        "free_blocks": total - used,
        "used_blocks": used,
        "kv_usage": used / total if total else 0.0,
        "kv_bytes": used * block_bytes,
        "kv_capacity_bytes": total * block_bytes,
        "running": running,
        "waiting": scheduler.num_unfinished - running,
        "embedding_fetches": fetch.fetches,
        "embedding_rows_fetched": fetch.rows,
        "embedding_feature_rows_fetched": fetch.feature_rows,
        "chunks_skipped": fetch.chunks_skipped,
        "grammar_compiles": grammars.compiles,
        "grammar_cache_hits": grammars.hits,
        **engine.memory_info(),
        **_kv_tier_stats(engine.kv_tier),
    }


def _kv_tier_stats(tier: KVTier | None) -> dict[str, Any]:
    if tier is None:
        zeros = dict.fromkeys(KV_TIER_COUNTERS, 0)
        return {"kv_store_enabled": 0, "kv_store_up": 0, **zeros, "kv_store_errors": {}}
    stats = tier.stats
    return {
        "kv_store_enabled": 1,
        "kv_store_up": int(tier.store.up),
        **{key: getattr(stats, key.removeprefix("kv_store_")) for key in KV_TIER_COUNTERS},
        "kv_store_errors": dict(stats.errors),
    }
