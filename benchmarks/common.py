"""Shared benchmark plumbing: results, bounded timing loops, the tiny checkpoint, stage processes.

Every timing loop here is bounded twice: by a repetition count and by a time budget
(whichever ends first, after a minimum number of repetitions). Reported figures are
medians of ``time.perf_counter`` samples taken after warm-up.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmcache.harness import Server, StageProcess, free_port

# --- results ---------------------------------------------------------------------------------------


@dataclass
class Result:
    """One measured ratio and its goal (``None``: a figure the issues set no goal for).

    ``higher_is_better`` picks the comparison: the goal is ``value >= goal`` or ``value <= goal``.
    """

    name: str
    description: str
    value: float
    goal: float | None
    higher_is_better: bool = True
    unit: str = "x"
    note: str = ""
    details: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        if self.goal is None:
            return True
        return self.value >= self.goal if self.higher_is_better else self.value <= self.goal

    @property
    def status(self) -> str:
        if self.goal is None:
            return "INFO"
        return "PASS" if self.passed else "MISS"

    def value_text(self) -> str:
        return f"{fmt_num(self.value)}{self.unit}"

    def goal_text(self) -> str:
        if self.goal is None:
            return "none"
        return f"{'>=' if self.higher_is_better else '<='} {fmt_num(self.goal)}{self.unit}"

    def line(self) -> str:
        note = f" [{self.note}]" if self.note else ""
        return (
            f"RESULT {self.name}: {self.description} = {self.value_text()} "
            f"(goal {self.goal_text()}) {self.status}{note}"
        )


def fmt_num(x: float) -> str:
    if x != x:  # NaN
        return "nan"
    ax = abs(x)
    if ax == 0:
        return "0"
    if ax >= 100:
        return f"{x:.0f}"
    if ax >= 10:
        return f"{x:.1f}"
    if ax >= 0.1:
        return f"{x:.2f}"
    if ax >= 0.001:
        return f"{x:.4f}"
    return f"{x:.2e}"


def fmt_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def report(results: Sequence[Result]) -> None:
    for r in results:
        print(r.line(), flush=True)


def main(
    run: Callable[..., list[Result]], doc: str | None = None, switches: dict[str, str] | None = None
) -> None:
    """The ``python -m mmcache.benchmarks.<name>`` entry point: ``--quick``, the benchmark's own
    on/off ``switches`` (flag name without dashes -> help; passed to ``run`` by keyword), and the
    RESULT lines."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (well under 30 s)")
    for flag, text in (switches or {}).items():
        parser.add_argument(f"--{flag}", action="store_true", help=text)
    args = parser.parse_args()
    start = time.perf_counter()
    results = run(**vars(args))
    print(f"# finished in {time.perf_counter() - start:.1f} s", flush=True)
    report(results)


def say(text: str) -> None:
    print(text, flush=True)


# --- timing ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Budget:
    """How much to sample: ``warmup`` untimed calls, then ``min_reps``..``max_reps`` timed calls
    until ``seconds`` have passed."""

    warmup: int = 1
    min_reps: int = 3
    max_reps: int = 50
    seconds: float = 2.0


def measure(fn: Callable[[], Any], budget: Budget) -> list[float]:
    """Wall times (seconds) of ``fn()`` calls, bounded by ``budget``."""
    for _ in range(budget.warmup):
        fn()
    times: list[float] = []
    deadline = time.perf_counter() + budget.seconds
    while len(times) < budget.max_reps and (len(times) < budget.min_reps or time.perf_counter() < deadline):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


async def ameasure(fn: Callable[[], Awaitable[Any]], budget: Budget) -> list[float]:
    """:func:`measure` for coroutines (each call awaited alone)."""
    for _ in range(budget.warmup):
        await fn()
    times: list[float] = []
    deadline = time.perf_counter() + budget.seconds
    while len(times) < budget.max_reps and (len(times) < budget.min_reps or time.perf_counter() < deadline):
        start = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - start)
    return times


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def spread(xs: Sequence[float]) -> str:
    """``median (min..max, n)`` for logs."""
    if not xs:
        return "no samples"
    return f"median {fmt_time(median(xs))} (min {fmt_time(min(xs))}, max {fmt_time(max(xs))}, n={len(xs)})"


# --- the checkpoint ------------------------------------------------------------------------------------


def model_dir(arch: str = "qwen2-vl", preset: str = "tiny") -> Path:
    """The checkpoint to benchmark: ``$MMCACHE_BENCH_MODEL``, else one of ``preset``'s size generated
    offline and kept in a cache directory keyed by the generator's source (so a changed generator
    regenerates)."""
    given = os.environ.get("MMCACHE_BENCH_MODEL")
    if given:
        return Path(given)
    from mmcache import tiny_families, tiny_model, tiny_presets

    source = b"".join(Path(m.__file__).read_bytes() for m in (tiny_model, tiny_families, tiny_presets))
    tag = hashlib.sha256(source).hexdigest()[:12]
    home = Path(os.environ.get("MMCACHE_HOME", Path.home() / ".cache" / "mmcache"))
    name = arch if preset == "tiny" else f"{arch}-{preset}"
    path = home / "bench" / f"{name}-{tag}"
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        say(f"# generating the {preset} {arch} checkpoint in {path}")
        tiny_model.make_tiny_model(path, arch, preset)
    return path


# --- processes: the package's harness (the one the end-to-end tests use) ---------------------------

__all__ = ["Server", "StageProcess", "free_port"]


def interleaved(fns: Sequence[Callable[[], Any]], budget: Budget) -> list[list[float]]:
    """Times of several functions sampled in turn (A, B, A, B, ...), so drift hits them alike."""
    for _ in range(budget.warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    deadline = time.perf_counter() + budget.seconds
    reps = 0
    while reps < budget.max_reps and (reps < budget.min_reps or time.perf_counter() < deadline):
        for fn, out in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
        reps += 1
    return times


async def ainterleaved(fns: Sequence[Callable[[], Awaitable[Any]]], budget: Budget) -> list[list[float]]:
    """:func:`interleaved` for coroutines."""
    for _ in range(budget.warmup):
        for fn in fns:
            await fn()
    times: list[list[float]] = [[] for _ in fns]
    deadline = time.perf_counter() + budget.seconds
    reps = 0
    while reps < budget.max_reps and (reps < budget.min_reps or time.perf_counter() < deadline):
        for fn, out in zip(fns, times, strict=True):
            start = time.perf_counter()
            await fn()
            out.append(time.perf_counter() - start)
        reps += 1
    return times
