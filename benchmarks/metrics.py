"""What the metrics and the request log add to the hot paths, in microseconds (CPU time of the
hooks themselves, so the figure does not move with the load on the machine):

(a) per processor request: the request record, its log line (text format, to a null stream)
    and the request's observations (one worker: the component counters sync at scrape time);
(b) per LLM engine step with 16 running sequences: the step hook (queue / prefill / TTFT /
    inter-token observations, one token per sequence);
(c) per vision forward: the encoder's batch observations;
(d) one scrape of the processor's and of the LLM stage's registry (off the hot path).
"""

from __future__ import annotations

import io
import logging
from types import SimpleNamespace

from mmcache.benchmarks.common import Budget, Result, main, measure, median, say
from mmcache.encoder_stage.metrics import EncoderMetrics
from mmcache.llm_stage.metrics import FAMILIES as LLM_FAMILIES
from mmcache.llm_stage.metrics import LLMMetrics
from mmcache.llm_stage.scheduler import StepOutput
from mmcache.llm_stage.sequence import SeqStatus
from mmcache.processor.metrics import ProcessorMetrics
from mmcache.processor.request_log import RequestRecord
from mmcache.shared.logs import TextFormatter

INNER = 200  # hook calls per timed sample

STATS = {
    "cache_hits": 10,
    "cache_misses": 3,
    "cache_evictions": 0,
    "decodes": 3,
    "file_reads": 0,
    "bytes_fetched": {"data": 1000, "file": 0, "http": 0},
    "repairs": {"missing": 0, "unreachable": 0},
    "failover_retries": {"llm": 0, "encoder": 0},
    "failover_migrations": 0,
    "failover_exhausted": 0,
    "unprobed_routes": 0,
    "cache_bytes": 100,
    "cache_capacity_bytes": 1000,
    "cache_entries": 3,
}
# NOTE: every number the LLM stage's metrics read, made from their own list (a copy of the keys
# would go stale as metrics are added)
LLM_STATS = {f.key: ({"x": 1} if f.label else 1) for f in LLM_FAMILIES}


def _per_call(fn, budget: Budget) -> float:
    def loop():
        for _ in range(INNER):
            fn()

    return median(measure(loop, budget)) / INNER


def processor_request(budget: Budget) -> float:
    metrics = ProcessorMetrics()
    log = logging.getLogger("bench.request")
    log.propagate = False
    handler = logging.StreamHandler(io.StringIO())
    handler.setFormatter(TextFormatter("%(asctime)s processor %(levelname)s %(name)s: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    counter = iter(range(10**9))

    def request():
        record = RequestRecord(prompt_tokens=300, cached_tokens=256, completion_tokens=32, stream=True)
        record.set_salt("tenant")
        record.mm_cache = {"processor_hits": 1, "processor_misses": 0, "encoder_hits": 0}
        record.first_token, record.e2e = record.started + 0.01, 0.05
        log.info("request", extra=record.fields())
        metrics.observe(record)
        metrics.request_done(lambda: {**STATS, "cache_hits": next(counter)})
        handler.stream.seek(0)
        handler.stream.truncate()

    return _per_call(request, budget)


def llm_step(budget: Budget, running: int = 16) -> float:
    metrics = LLMMetrics(lambda: LLM_STATS)
    seqs = [SimpleNamespace(seq_id=i, status=SeqStatus.RUNNING) for i in range(running)]
    for seq in seqs:
        metrics.track(seq, 0.0)
    outputs = [StepOutput(seq.seq_id, 7, None, 300, 256) for seq in seqs]
    metrics.step(0.0, 0.001, outputs)  # first tokens: every later step is inter-token
    clock = iter(range(1, 10**9))

    def step():
        t = next(clock) * 0.002
        metrics.step(t, t + 0.002, outputs)

    return _per_call(step, budget)


def encoder_forward(budget: Budget) -> float:
    metrics = EncoderMetrics(lambda: {})
    return _per_call(lambda: metrics.forward(4, 1024, 0.01), budget)


def scrapes(budget: Budget) -> tuple[float, float]:
    from prometheus_client import generate_latest

    processor = ProcessorMetrics()
    processor.sync(STATS)
    llm = LLMMetrics(lambda: LLM_STATS)
    return (
        median(measure(processor.render, budget)),
        median(measure(lambda: generate_latest(llm.registry), budget)),
    )


def run(quick: bool = False) -> list[Result]:
    budget = Budget(warmup=2, min_reps=5, max_reps=30, seconds=0.5 if quick else 2.0)
    say("# metrics: cost of the hooks per call")
    per_request = processor_request(budget)
    per_step = llm_step(budget)
    per_forward = encoder_forward(budget)
    processor_scrape, llm_scrape = scrapes(budget)
    say(f"  processor, per request: {per_request * 1e6:.1f} us (record, log line, observations)")
    say(f"  LLM stage, per engine step with 16 sequences: {per_step * 1e6:.1f} us")
    say(f"  encoder, per vision forward: {per_forward * 1e6:.1f} us")
    say(f"  one scrape: processor {processor_scrape * 1e3:.2f} ms, LLM stage {llm_scrape * 1e3:.2f} ms")
    return [
        Result(name, text, seconds * 1e6, None, unit=" us")
        for name, text, seconds in (
            ("metrics.processor_request", "processor bookkeeping per request", per_request),
            ("metrics.llm_step", "LLM step hook, 16 sequences", per_step),
            ("metrics.encoder_forward", "encoder forward hook", per_forward),
        )
    ]


if __name__ == "__main__":
    main(run, __doc__)
