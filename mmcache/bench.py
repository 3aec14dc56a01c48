"""``mmcache bench [names]``: run benchmark modules and print their ratios as one table.

The modules live in the repository's ``benchmarks/`` package (``hashing``, ``processor_cache``,
``encoder``, ``llm``); each measures its ratios in one run. A missed goal is reported as
``MISS`` but does not fail the command: the exit status is 0 unless a benchmark crashed (1)
or a name is unknown (2). ``MMCACHE_BENCH_QUICK=1`` (or ``python -m mmcache.bench --quick``)
runs the short versions.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import time
import traceback
from pathlib import Path


def _modules() -> tuple[str, ...]:
    from mmcache.benchmarks import MODULES

    return MODULES


def run_benchmarks(
    names: list[str] | None = None, quick: bool | None = None, results_dir: Path | None = None
) -> int:
    """Run the named benchmark modules (default: all), print a table; returns the exit status.
    ``results_dir``: also write the results there as one JSON file (:mod:`mmcache.results`)."""
    available = _modules()
    chosen = list(names or available)
    unknown = [n for n in chosen if n not in available]
    if unknown:
        print(
            f"unknown benchmark(s): {', '.join(unknown)}; available: {', '.join(available)}", file=sys.stderr
        )
        return 2
    if quick is None:
        quick = os.environ.get("MMCACHE_BENCH_QUICK", "").lower() in ("1", "true", "yes", "on")
    rows: list[tuple[str, float, list]] = []
    failed: list[str] = []
    for name in chosen:
        print(f"=== benchmark {name}{' (quick)' if quick else ''} ===", flush=True)
        start = time.perf_counter()
        try:
            results = importlib.import_module(f"mmcache.benchmarks.{name}").run(quick=quick)
        except Exception:
            traceback.print_exc()
            failed.append(name)
            results = []
        elapsed = time.perf_counter() - start
        for r in results:
            print(r.line(), flush=True)
        print(f"=== {name}: {elapsed:.1f} s ===\n", flush=True)
        rows.append((name, elapsed, results))
    _table(rows, failed)
    if results_dir is not None:
        print(f"wrote {_save(results_dir, rows, failed, quick)}")
    return 1 if failed else 0


def _save(directory: Path, rows: list[tuple[str, float, list]], failed: list[str], quick: bool) -> Path:
    from mmcache.results import record, write

    results = [
        {"module": name, "seconds": round(elapsed, 1), **dataclasses.asdict(r), "status": r.status}
        for name, elapsed, results in rows
        for r in results
    ]
    return write(directory, record("builtin", {"quick": quick, "crashed": failed, "results": results}))


def _table(rows: list[tuple[str, float, list]], failed: list[str]) -> None:
    lines = [("result", "value", "goal", "status", "module time", "ratio")]
    for name, elapsed, results in rows:
        if name in failed:
            lines.append((name, "-", "-", "ERROR", f"{elapsed:.1f} s", "crashed (traceback above)"))
        for r in results:
            lines.append((r.name, r.value_text(), r.goal_text(), r.status, f"{elapsed:.1f} s", r.description))
    widths = [max(len(line[i]) for line in lines) for i in range(5)]
    print("=== summary ===")
    for i, line in enumerate(lines):
        print("  ".join(cell.ljust(w) for cell, w in zip(line[:5], widths, strict=True)) + "  " + line[5])
        if i == 0:
            print("  ".join("-" * w for w in widths) + "  " + "-" * 5)
    goals = [r for _, _, results in rows for r in results if r.goal is not None]
    misses = sum(1 for r in goals if not r.passed)
    print(f"{len(goals) - misses}/{len(goals)} goals met, {misses} MISS, {len(failed)} crashed", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmcache.bench", description=__doc__)
    parser.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    parser.add_argument("--quick", action="store_true", help="the short versions")
    parser.add_argument("--results-dir", type=Path, default=None, help="also write the results there (JSON)")
    args = parser.parse_args(argv)
    return run_benchmarks(args.names, quick=True if args.quick else None, results_dir=args.results_dir)


if __name__ == "__main__":
    sys.exit(main())
