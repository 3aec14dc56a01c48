"""Read a deployment's Prometheus metrics: the processor's ``/metrics`` and every stage replica's
(their URLs come from the processor's ``/health``). Used by ``mmcache bench``, the benchmarks
and the tests, parsed with prometheus_client's own parser."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families


@dataclass
class Samples:
    """Samples of one or more endpoints: ``(name, sorted label pairs) → value`` (name as exposed,
    e.g. ``mmcache_llm_prefix_cache_hits_total``), and each family's type."""

    values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Samples:
        out = cls()
        for family in text_string_to_metric_families(text):
            out.types[family.name] = family.type
            for s in family.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                out.values[key] = out.values.get(key, 0.0) + s.value
        return out

    def merge(self, other: Samples) -> Samples:
        """Both together; a sample in both (two replicas) is summed."""
        out = Samples(dict(self.values), {**self.types, **other.types})
        for key, v in other.values.items():
            out.values[key] = out.values.get(key, 0.0) + v
        return out

    def total(self, name: str, **labels: str) -> float:
        """Sum over every sample called ``name`` whose labels include ``labels``."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.values.items() if n == name and want <= set(ls))

    def names(self) -> set[str]:
        return {n for n, _ in self.values}

    def by_name(self) -> dict[str, float]:
        """``{name: value summed over labels}`` (a ``le`` bucket sum is meaningless; use ``total``)."""
        out: dict[str, float] = defaultdict(float)
        for (n, _), v in self.values.items():
            out[n] += v
        return dict(out)

    def __getitem__(self, name: str) -> float:
        return self.total(name)


def fetch_text(url: str, timeout: float = 30) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def scrape(url: str, timeout: float = 30) -> Samples:
    return Samples.parse(fetch_text(url, timeout))


@dataclass(frozen=True)
class Endpoint:
    stage: str  # processor, encoder or llm
    address: str  # the processor's URL, or the replica's ZeroMQ address
    url: str  # its /metrics


def endpoints(processor_url: str, timeout: float = 30) -> list[Endpoint]:
    """The processor and each live stage replica it knows, with their metrics URLs."""
    try:
        with urllib.request.urlopen(processor_url.rstrip("/") + "/health", timeout=timeout) as resp:
            health = json.loads(resp.read())
    except urllib.error.HTTPError as err:  # 503: some replica is down; the rest still count
        health = json.loads(err.read() or b"{}")
    out = [Endpoint("processor", processor_url, processor_url.rstrip("/") + "/metrics")]
    out += [
        Endpoint(s["stage"], s["address"], s["metrics_url"])
        for s in health.get("stages", [])
        if s.get("metrics_url")
    ]
    return out


def scrape_endpoints(eps: Iterable[Endpoint], timeout: float = 30) -> list[tuple[Endpoint, Samples]]:
    return [(ep, scrape(ep.url, timeout)) for ep in eps]


def scrape_deployment(processor_url: str, timeout: float = 30) -> Samples:
    """Every sample of the processor and of its stage replicas, replicas summed."""
    merged = Samples()
    for _, samples in scrape_endpoints(endpoints(processor_url, timeout), timeout):
        merged = merged.merge(samples)
    return merged
