"""The LLM stage's Prometheus metrics (``mmcache_llm_*``): engine counters read from the
service's ``stats()`` at scrape time, and per-request latencies observed as they happen.

Latencies follow vLLM's engine-side definitions, measured from the moment this replica
received the request: queue time (submitted to the engine → first scheduled step), prefill
time (first scheduled step → first token), time to first token, inter-token latency (one
observation per token after the first) and end-to-end latency (→ last token).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram

from mmcache.llm_stage.scheduler import StepOutput
from mmcache.llm_stage.sequence import SeqStatus, Sequence
from mmcache.shared.messages import ErrorReply
from mmcache.shared.metrics import LATENCY_BUCKETS, TOKEN_BUCKETS, Family, Stats, StatsCollector

FAMILIES = [
    Family(
        "mmcache_llm_prefix_cache_queries",
        "counter",
        "prompt tokens looked up in the prefix cache",
        "prefix_queries",
    ),
    Family(
        "mmcache_llm_prefix_cache_hits", "counter", "prompt tokens served by the prefix cache", "prefix_hits"
    ),
    Family("mmcache_llm_kv_evictions", "counter", "cached KV blocks evicted for reuse", "evictions"),
    Family("mmcache_llm_preemptions", "counter", "sequences preempted for lack of KV blocks", "preemptions"),
    Family("mmcache_llm_engine_steps", "counter", "engine steps run", "steps"),
    Family(
        "mmcache_llm_engine_step_failures",
        "counter",
        "engine steps that raised (their requests failed; any outside the model call: the replica "
        "stops serving)",
        "step_failures",
    ),
    Family(
        "mmcache_llm_healthy",
        "gauge",
        "1 while the engine can be trusted; 0 once a step failed outside the model call (the replica "
        "then answers its heartbeat as unhealthy and refuses requests)",
        "healthy",
    ),
    Family("mmcache_llm_kv_blocks_used", "gauge", "KV blocks in use (held by sequences)", "used_blocks"),
    Family("mmcache_llm_kv_blocks_free", "gauge", "KV blocks free (cached or empty)", "free_blocks"),
    Family("mmcache_llm_kv_cache_usage_ratio", "gauge", "fraction of KV blocks in use", "kv_usage"),
    Family("mmcache_llm_kv_cache_bytes", "gauge", "bytes of KV blocks in use", "kv_bytes"),
    Family("mmcache_llm_kv_cache_capacity_bytes", "gauge", "bytes of the KV block pool", "kv_capacity_bytes"),
    Family(
        "mmcache_llm_kv_budget_bytes",
        "gauge",
        "--kv-cache-gb in bytes: the KV pool and the prompt logprob store beside it",
        "kv_budget_bytes",
    ),
    Family(
        "mmcache_llm_prompt_logprob_store_bytes",
        "gauge",
        "bytes of the prompt logprob store beside the KV blocks",
        "prompt_logprob_store_bytes",
    ),
    Family(
        "mmcache_llm_prompt_logprob_blocks",
        "gauge",
        "KV blocks that carry prompt logprobs",
        "prompt_logprob_blocks",
    ),
    Family("mmcache_llm_requests_running", "gauge", "sequences being computed", "running"),
    Family("mmcache_llm_requests_waiting", "gauge", "sequences waiting for blocks or media rows", "waiting"),
    Family(
        "mmcache_llm_embedding_fetches", "counter", "embedding row reads from encoders", "embedding_fetches"
    ),
    Family(
        "mmcache_llm_embedding_rows_fetched",
        "counter",
        "embedding rows pulled from encoders",
        "embedding_rows_fetched",
    ),
    Family(
        "mmcache_llm_embedding_feature_rows_fetched",
        "counter",
        "embedding rows pulled, counted once per feature set (deepstack families have several)",
        "embedding_feature_rows_fetched",
    ),
    Family(
        "mmcache_llm_chunks_skipped",
        "counter",
        "media chunks the cached prefix covered (not fetched)",
        "chunks_skipped",
    ),
    Family(
        "mmcache_llm_kv_store_enabled",
        "gauge",
        "1 when the shared KV tier (--kv-store) is on",
        "kv_store_enabled",
    ),
    Family(
        "mmcache_llm_kv_store_up", "gauge", "1 unless the KV store's last read or write failed", "kv_store_up"
    ),
    Family(
        "mmcache_llm_kv_store_lookups", "counter", "reads sent to the shared KV store", "kv_store_lookups"
    ),
    Family(
        "mmcache_llm_kv_store_skipped",
        "counter",
        "reads not sent: the KV store had failed, or a probe found the next block absent, moments before",
        "kv_store_skipped",
    ),
    Family(
        "mmcache_llm_kv_store_hits",
        "counter",
        "KV blocks read from the store and verified",
        "kv_store_hit_blocks",
    ),
    Family(
        "mmcache_llm_kv_store_misses",
        "counter",
        "reads that stopped at a block the store lacks",
        "kv_store_miss_blocks",
    ),
    Family(
        "mmcache_llm_kv_store_loaded_blocks",
        "counter",
        "KV blocks from the store copied into the pool",
        "kv_store_loaded_blocks",
    ),
    Family("mmcache_llm_kv_store_bytes_in", "counter", "bytes read from the KV store", "kv_store_bytes_in"),
    Family(
        "mmcache_llm_kv_store_bytes_out", "counter", "bytes written to the KV store", "kv_store_bytes_out"
    ),
    Family(
        "mmcache_llm_kv_store_written_blocks",
        "counter",
        "KV blocks written to the store",
        "kv_store_written_blocks",
    ),
    Family(
        "mmcache_llm_kv_store_dropped_blocks",
        "counter",
        "KV blocks not written: queue full, store down or the write failed",
        "kv_store_dropped_blocks",
    ),
    Family(
        "mmcache_llm_kv_store_errors",
        "counter",
        "KV store faults, by reason (store: timeout, connection, full; value refused: truncated, "
        "length, checksum, layout, hash, format, tokens); each is served by computing",
        "kv_store_errors",
        "reason",
    ),
]


_UNSCHEDULED = (SeqStatus.WAITING, SeqStatus.WAITING_FOR_GRAMMAR, SeqStatus.WAITING_FOR_KV)


@dataclass(slots=True)
class _Timing:
    seq: Sequence
    arrived: float
    submitted: float
    scheduled: float | None = None
    last_token: float | None = None


class LLMMetrics:
    def __init__(self, stats: Callable[[], Stats]):
        self.registry = CollectorRegistry()
        self.registry.register(StatsCollector(stats, FAMILIES))
        r = self.registry

        def seconds(name: str, text: str, buckets=LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, text, buckets=buckets, registry=r)

        self.ttft = seconds("mmcache_llm_time_to_first_token_seconds", "request received → first token")
        self.itl = seconds(
            "mmcache_llm_inter_token_latency_seconds", "gap between two tokens of a request", TOKEN_BUCKETS
        )
        self.e2e = seconds("mmcache_llm_e2e_request_latency_seconds", "request received → last token")
        # NOTE: next to the inter-token latency it tells the step from the loop around it
        self.step_seconds = seconds(
            "mmcache_llm_engine_step_seconds", "one computed step: scheduling, model, sampling", TOKEN_BUCKETS
        )
        self.queue = seconds(
            "mmcache_llm_request_queue_time_seconds", "submitted to the engine → first scheduled"
        )
        self.prefill = seconds("mmcache_llm_request_prefill_time_seconds", "first scheduled → first token")
        self.fetch = seconds(
            "mmcache_llm_embedding_fetch_seconds",
            "pulling one request's embedding rows (requests that pulled any)",
        )
        self.kv_store_latency = seconds(
            "mmcache_llm_kv_store_read_seconds", "one read of a prefix's blocks from the shared KV store"
        )
        self.prompt_tokens = Counter(
            "mmcache_llm_prompt_tokens", "prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter("mmcache_llm_generation_tokens", "tokens generated", registry=r)
        self.requests = Counter(
            "mmcache_llm_requests", "requests ended, by finish reason", ["finish_reason"], registry=r
        )
        # NOTE: every error reply to a generate request, whether it came before the engine saw it
        # (validation, a full queue, a grammar that does not compile) or from the engine or a
        # failed repair; the latter also count as finish_reason="error" above.
        self.errors = Counter(
            "mmcache_llm_request_errors",
            "generate requests ended with an error reply, by HTTP status and error code",
            ["status", "code"],
            registry=r,
        )
        # NOTE: a repair has the processor encode rows again for a live request; causes: missing
        # (evicted, or never encoded because a cached prefix covered them) and unreachable (an
        # encoder did not answer).
        self.repairs = Counter(
            "mmcache_llm_repairs", "mid-request repairs of media rows, by cause", ["cause"], registry=r
        )
        for cause in ("missing", "unreachable"):
            self.repairs.labels(cause)  # every cause is a series from the start
        self._timings: dict[int, _Timing] = {}
        self._unscheduled: dict[int, _Timing] = {}

    def errored(self, error: ErrorReply) -> None:
        self.errors.labels(str(error.status), error.code).inc()

    def fetched(self, seconds: float) -> None:
        self.fetch.observe(seconds)

    def track(self, seq: Sequence, arrived: float) -> None:
        """``seq`` is about to be submitted to the engine; it arrived (perf_counter) at ``arrived``."""
        timing = _Timing(seq, arrived, time.perf_counter())
        self._timings[seq.seq_id] = timing
        self._unscheduled[seq.seq_id] = timing

    def forget(self, seq_id: int) -> None:
        self._timings.pop(seq_id, None)
        self._unscheduled.pop(seq_id, None)

    def step(self, started: float, ended: float, outputs: list[StepOutput], computed: bool = True) -> None:
        """An engine step ran from ``started`` to ``ended`` and produced ``outputs`` (``computed``:
        it ran the model)."""
        if computed:
            self.step_seconds.observe(ended - started)
        for seq_id, t in list(self._unscheduled.items()):
            if t.seq.status not in _UNSCHEDULED:  # admitted this step (or ended)
                t.scheduled = started
                self.queue.observe(started - t.submitted)
                del self._unscheduled[seq_id]
        for out in outputs:
            timing = self._timings.get(out.seq_id)
            if timing is None:
                continue
            t = timing
            if out.token_id is not None:
                self.generation_tokens.inc()
                if t.last_token is None:
                    self.ttft.observe(ended - t.arrived)
                    self.prefill.observe(ended - (t.scheduled if t.scheduled is not None else started))
                else:
                    self.itl.observe(ended - t.last_token)
                t.last_token = ended
            if out.finish_reason is not None:
                self.requests.labels(out.finish_reason).inc()
                if out.finish_reason in ("stop", "length"):
                    self.e2e.observe(ended - t.arrived)
                    self.prompt_tokens.inc(out.num_prompt_tokens)
                self.forget(out.seq_id)
