"""What a run measured: a summary (throughput, TTFT / ITL / latency percentiles, per-tier hit
rates from ``/metrics`` deltas), the JSON result file, PNG plots (matplotlib) and the ratios of
two runs (``--compare``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from mmcache.loadgen.runner import Run
from mmcache.loadgen.workloads import Options
from mmcache.scrape import Samples

PERCENTILES = (50, 90, 99)
# tier → (hits, lookups) counters; a tier's hit rate over a run is Δhits / Δlookups.
TIERS = {
    "processor": ("mmcache_processor_cache_hits_total", ("mmcache_processor_cache_misses_total",)),
    "encoder": ("mmcache_encoder_cache_hits_total", ("mmcache_encoder_cache_misses_total",)),
    "prefix (tokens)": ("mmcache_llm_prefix_cache_hits_total", None),
}


def _percentiles(xs: list[float]) -> dict[str, float | None]:
    arr = np.asarray(xs) if xs else None
    out: dict[str, float | None] = {}
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(arr, p)) if arr is not None else None
    out["mean"] = float(arr.mean()) if arr is not None else None
    return out


def hit_rates(before: Samples | None, after: Samples | None) -> dict[str, float | None]:
    """Per-tier hit rate over the run, from the deployment's counters (None: not measured)."""
    if before is None or after is None:
        return {}
    out: dict[str, float | None] = {}
    for tier, (hits_name, miss_names) in TIERS.items():
        hits = after.total(hits_name) - before.total(hits_name)
        if miss_names is None:  # the prefix cache counts lookups itself
            q = "mmcache_llm_prefix_cache_queries_total"
            lookups = after.total(q) - before.total(q)
        else:
            lookups = hits + sum(after.total(m) - before.total(m) for m in miss_names)
        out[tier] = hits / lookups if lookups > 0 else None
    return out


def summary(run: Run) -> dict:
    ok = [o for o in run.outcomes if o.ok]
    tokens = sum(o.completion_tokens for o in ok)
    itl = [b - a for o in ok for a, b in zip(o.token_times, o.token_times[1:], strict=False)]
    return {
        "url": run.url,
        "model": run.model,
        "workload": run.options.workload,
        "options": vars(run.options) | {"concurrency": run.concurrency, "request_rate": run.request_rate},
        "requests": len(run.outcomes),
        "failed": len(run.outcomes) - len(ok),
        "errors": sorted({o.error or f"HTTP {o.status}" for o in run.outcomes if not o.ok})[:10],
        "duration_s": run.duration,
        "request_throughput": len(ok) / run.duration,
        "output_throughput": tokens / run.duration,
        "prompt_tokens": sum(o.prompt_tokens for o in ok),
        "cached_tokens": sum(o.cached_tokens for o in ok),
        "completion_tokens": tokens,
        "ttft_s": _percentiles([o.ttft for o in ok if o.ttft is not None]),
        "itl_s": _percentiles(itl),
        "latency_s": _percentiles([o.latency for o in ok]),
        "hit_rates": hit_rates(run.metrics_before, run.metrics_after),
    }


def write_json(path: Path, runs: list[Run], summaries: list[dict]) -> None:
    doc: dict[str, object] = {
        "runs": [
            s | {"outcomes": [o.as_dict() for o in r.outcomes]} for r, s in zip(runs, summaries, strict=True)
        ]
    }
    if len(summaries) == 2:
        doc["ratios"] = ratios(summaries[0], summaries[1])
    path.write_text(json.dumps(doc, indent=2))


def save_results(directory: Path, options: Options, runs: list[Run], summaries: list[dict]) -> Path:
    """The summaries (not every request) as a results file with commit, date and machine."""
    from mmcache.results import record, write

    body: dict[str, object] = {
        "workload": dataclasses.asdict(options),
        "urls": [r.url for r in runs],
        "runs": summaries,
    }
    if len(summaries) == 2:
        body["ratios"] = ratios(summaries[0], summaries[1])
    return write(directory, record("load", body))


def ratios(a: dict, b: dict) -> dict[str, float | None]:
    """``a / b`` for throughputs and latency percentiles (below 1 for latencies: ``a`` is faster)."""
    pairs = {
        "output_throughput": (a["output_throughput"], b["output_throughput"]),
        "request_throughput": (a["request_throughput"], b["request_throughput"]),
    }
    for metric in ("ttft_s", "itl_s", "latency_s"):
        for p in ("p50", "p90", "p99", "mean"):
            pairs[f"{metric}_{p}"] = (a[metric][p], b[metric][p])
    return {k: (x / y if x is not None and y else None) for k, (x, y) in pairs.items()}


def print_summary(s: dict) -> None:
    def ms(d: dict) -> str:
        return "  ".join(f"{k} {v * 1e3:.1f} ms" if v is not None else f"{k} -" for k, v in d.items())

    print(f"== {s['url']}  ({s['workload']}, {s['requests']} requests, {s['failed']} failed)")
    rates = f"{s['output_throughput']:.1f} tokens/s, {s['request_throughput']:.2f} requests/s"
    print(f"   output throughput {rates}")
    print(f"   TTFT     {ms(s['ttft_s'])}")
    print(f"   ITL      {ms(s['itl_s'])}")
    print(f"   latency  {ms(s['latency_s'])}")
    if s["prompt_tokens"]:
        print(f"   cached prompt tokens {s['cached_tokens']} of {s['prompt_tokens']}")
    hits = "  ".join(f"{t} {r:.0%}" for t, r in s["hit_rates"].items() if r is not None)
    if hits:
        print(f"   hit rates (from /metrics)  {hits}")
    for e in s["errors"]:
        print(f"   error: {e}")


def print_ratios(r: dict[str, float | None], a: str, b: str) -> None:
    print(f"== ratios {a} / {b}")
    for k, v in r.items():
        print(f"   {k:24s} {v:.3f}x" if v is not None else f"   {k:24s} -")


def plot(path: Path, runs: list[Run], summaries: list[dict]) -> None:
    """TTFT CDF, output throughput over time, per-tier hit rates: one PNG."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, (cdf, tput, hits) = plt.subplots(1, 3, figsize=(16, 4.5))
    for run, s in zip(runs, summaries, strict=True):
        label = f"{run.url} ({s['workload']})"
        ttfts = np.sort([o.ttft * 1e3 for o in run.outcomes if o.ok and o.ttft is not None])
        if len(ttfts):
            cdf.plot(ttfts, np.arange(1, len(ttfts) + 1) / len(ttfts), label=label)
        times = np.asarray([t for o in run.outcomes if o.ok for t in o.token_times])
        if len(times):
            width = max(run.duration / 40, 0.05)
            edges = np.arange(0.0, run.duration + width, width)
            counts, _ = np.histogram(times, edges)
            tput.plot(edges[:-1], counts / width, label=label)
    cdf.set(xlabel="time to first token (ms)", ylabel="fraction of requests", title="TTFT CDF")
    tput.set(xlabel="time since start (s)", ylabel="content chunks / s", title="output throughput over time")
    tiers = list(TIERS)
    width = 0.8 / max(len(runs), 1)
    for i, (run, s) in enumerate(zip(runs, summaries, strict=True)):
        values = [s["hit_rates"].get(t) or 0.0 for t in tiers]
        hits.bar(np.arange(len(tiers)) + i * width, values, width, label=run.url)
    hits.set_xticks(np.arange(len(tiers)) + width * (len(runs) - 1) / 2, tiers)
    hits.set(ylim=(0, 1), ylabel="hit rate over the run", title="per-tier hit rates (/metrics deltas)")
    for ax in (cdf, tput, hits):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
