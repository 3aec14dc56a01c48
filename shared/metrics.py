"""Prometheus plumbing every stage shares: a collector over a component's ``stats()`` numbers,
the per-stage metrics HTTP port, and where a replica's metrics live.

Counters that components already keep as plain ints are read at scrape time by
:class:`StatsCollector` (nothing added to the hot path); latencies are prometheus_client
histograms the stages observe directly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from aiohttp import web
from prometheus_client import CollectorRegistry, disable_created_metrics
from prometheus_client.aiohttp import make_aiohttp_handler
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

# Seconds, from a cached request's few milliseconds on a small model to a long generation.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
# Per-token gaps are shorter: one engine step.
TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

Stats = Mapping[str, "int | float | Mapping[str, int | float]"]


@dataclass(frozen=True, slots=True)
class Family:
    """One metric read from a ``stats()`` key. A mapping value becomes one sample per entry,
    labelled ``label``; a counter's exposed name gets ``_total`` from prometheus_client."""

    name: str
    kind: str  # "counter" or "gauge"
    help: str
    key: str
    label: str | None = None


class StatsCollector(Collector):
    """Yields ``families`` from ``stats()`` at each scrape.

    NOTE: ``stats`` runs on the event loop while a worker thread (the LLM engine's step) may be
    changing the numbers: it must only read ints and ``len()``s, never iterate a container
    that another thread may resize.
    """

    def __init__(self, stats: Callable[[], Stats], families: list[Family]):
        self._stats = stats
        self._families = families

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for f in self._families:
            value = stats[f.key]
            cls = CounterMetricFamily if f.kind == "counter" else GaugeMetricFamily
            if not isinstance(value, Mapping):
                yield cls(f.name, f.help, value=value)
                continue
            assert f.label is not None, f"{f.key}: a mapping of samples needs a label"
            family = cls(f.name, f.help, labels=[f.label])
            for label, v in sorted(value.items()):
                family.add_metric([label], v)
            yield family


def setup_metrics() -> None:
    """Once per stage process: no ``*_created`` series (one per counter and histogram, which
    Prometheus does not need and which double what a scrape carries)."""
    disable_created_metrics()


class MetricsServer:
    """``/metrics`` of one stage replica on a port of its own, served from the stage's event loop
    (aiohttp, prometheus_client's handler), so that every replica is scraped on its own."""

    def __init__(self, runner: web.AppRunner | None, port: int | None):
        self._runner = runner
        self.port = port  # the bound port; None when turned off

    @classmethod
    async def start(cls, registry: CollectorRegistry, port: int, host: str = "0.0.0.0") -> MetricsServer:
        """Listen on ``port`` (0: any free port; -1: not at all)."""
        if port < 0:
            return cls(None, None)
        app = web.Application()
        app.router.add_get("/metrics", make_aiohttp_handler(registry))
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        bound = runner.addresses[0][1]
        log.info("metrics on http://%s:%d/metrics", host, bound)
        return cls(runner, bound)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


def metrics_url(address: str, port: int | None) -> str | None:
    """Where the stage replica reached at ZeroMQ ``address`` serves its metrics: the same host
    (loopback for an ipc:// socket), the port it reported."""
    if port is None:
        return None
    parts = urlsplit(address)
    host = parts.hostname if parts.scheme == "tcp" and parts.hostname else "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/metrics"
