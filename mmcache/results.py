"""Benchmark results as data: one JSON file per run, with the commit, date and machine it ran on.

``mmcache bench --results-dir DIR`` writes one (the built-in benchmarks, or a load against a
deployment); ``benchmarks/results/`` keeps the project's history of them, newest last by name.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REQUIRED = ("kind", "commit", "date", "machine")
_GIT_TIMEOUT = 5.0  # seconds; a results file is still written without the commit


def _git(*args: str) -> str | None:
    root = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=_GIT_TIMEOUT, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def commit() -> str:
    """The checkout's commit (``+dirty`` with uncommitted changes), or ``unknown`` outside git."""
    head = _git("rev-parse", "--short=12", "HEAD")
    if head is None:
        return "unknown"
    return head + ("+dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30), 1)
    except (ValueError, OSError):
        return None


def machine() -> dict[str, Any]:
    """What the figures depend on: cores, CPU, memory, GPU, and how busy the machine was."""
    gpu = None
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return {
        "cpus": len(os.sched_getaffinity(0)),
        "cpu": _cpu_model(),
        "memory_gib": _memory_gib(),
        "gpu": gpu,
        "python": platform.python_version(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def record(kind: str, body: dict[str, Any]) -> dict[str, Any]:
    """A results document: ``kind``, commit, date (UTC), machine, then ``body``."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"kind": kind, "commit": commit(), "date": now, "machine": machine(), **body}


def write(directory: Path, doc: dict[str, Any]) -> Path:
    """Write ``doc`` as ``DIR/<date>-<kind>-<commit>.json``; returns the path."""
    directory.mkdir(parents=True, exist_ok=True)
    stamp = doc["date"].replace(":", "").replace("-", "")
    path = directory / f"{stamp}-{doc['kind']}-{doc['commit'].replace('+', '-')}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path
