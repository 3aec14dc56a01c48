"""Find Prometheus's ``promtool`` for the metrics tests, unpacking it from Debian's package
(``scripts/install-promtool``) when this machine has none yet."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = Path.home() / ".cache" / "mmcache" / "bin"


def promtool() -> Path:
    for candidate in (shutil.which("promtool"), Path(sys.executable).parent / "promtool", CACHE / "promtool"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    done = subprocess.run(
        [str(REPO / "scripts" / "install-promtool"), str(CACHE)], capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0:
        raise RuntimeError(f"promtool is missing and could not be installed:\n{done.stderr}")
    return CACHE / "promtool"


def check_metrics(text: str) -> str:
    """``promtool check metrics`` on ``text``; returns its complaints ('' when clean)."""
    done = subprocess.run(
        [str(promtool()), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    return "" if done.returncode == 0 and not done.stdout.strip() else (done.stdout + done.stderr)
