"""Every benchmark module imports (they run only by hand, so nothing else would notice one that
broke when a helper it uses moved or went away)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

from mmcache import benchmarks

MODULES = sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__, "benchmarks."))


def test_there_are_benchmarks():
    assert len(MODULES) >= 5, MODULES


@pytest.mark.parametrize("name", MODULES)
def test_benchmark_imports(name):
    module = importlib.import_module(name)
    assert module.__doc__, f"{name} says what it measures"


def test_the_metrics_benchmark_runs_against_the_metrics_as_they_are():
    """It feeds the stages' metrics hand-made stats (well under a second): a key they read and
    it lacks would crash it, as happened when metrics were added."""
    from mmcache.benchmarks import metrics

    results = metrics.run(quick=True)
    assert {r.name for r in results} >= {"metrics.processor_request", "metrics.llm_step"}
