"""Shared benchmark plumbing: results, bounded timing loops, the tiny checkpoint, stage processes.

Every timing loop here is bounded twice: by a repetition count and by a time budget
(whichever ends first, after a minimum number of repetitions). Reported figures are
medians of ``time.perf_counter`` samples taken after warm-up.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmcache.launcher import die_with_parent
from tests.e2e.server import alive as _alive
from tests.e2e.server import descendants, free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # ``tests.media`` and the stages, from any working directory
    sys.path.insert(0, str(REPO_ROOT))

STARTUP_TIMEOUT = 180.0
STOP_TIMEOUT = 30.0


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


def main(run: Callable[..., list[Result]], doc: str | None = None) -> None:
    """The ``python -m benchmarks.<name>`` entry point: ``--quick`` and the RESULT lines."""
    parser = argparse.ArgumentParser(description=doc)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (well under 30 s)")
    args = parser.parse_args()
    start = time.perf_counter()
    results = run(quick=args.quick)
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


def model_dir(arch: str = "qwen2-vl") -> Path:
    """The tiny checkpoint to benchmark: ``$MMCACHE_BENCH_MODEL``, else one generated offline and
    kept in a cache directory keyed by the generator's source (so a changed generator regenerates)."""
    given = os.environ.get("MMCACHE_BENCH_MODEL")
    if given:
        return Path(given)
    from mmcache import tiny_model

    source = Path(tiny_model.__file__).read_bytes()
    tag = hashlib.sha256(source).hexdigest()[:12]
    home = Path(os.environ.get("MMCACHE_HOME", Path.home() / ".cache" / "mmcache"))
    path = home / "bench" / f"{arch}-{tag}"
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        say(f"# generating the tiny {arch} checkpoint in {path}")
        tiny_model.make_tiny_model(path, arch)
    return path


# --- processes -----------------------------------------------------------------------------------------
# NOTE: the same process helpers the end-to-end tests use (and the launcher's parent-death signal).


_LIVE: set[StageProcess] = set()


class StageProcess:
    """A child process tree (``python -m module args``) that is always stopped: by :meth:`stop`, at
    interpreter exit, or by the kernel when this process dies (PR_SET_PDEATHSIG)."""

    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None, module: str = "mmcache"):
        self.log_path = Path(tempfile.mkstemp(prefix="mmcache-bench-", suffix=".log")[1])
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        full_env = {**os.environ, "MMCACHE_LOG_LEVEL": "WARNING", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            env=full_env,
            cwd=REPO_ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )
        self.tree: set[int] = set()
        _LIVE.add(self)

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def check_running(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"mmcache exited with {self.proc.returncode}:\n{self.log_tail()}")

    def stop(self) -> set[int]:
        """SIGTERM, wait, SIGKILL what is left of the tree; returns pids that had to be killed."""
        if self not in _LIVE:
            return set()
        _LIVE.discard(self)
        tree = self.tree | descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        deadline = time.monotonic() + 10
        alive = {pid for pid in tree if _alive(pid)}
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = {pid for pid in alive if _alive(pid)}
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._log.close()
        with contextlib.suppress(OSError):
            self.log_path.unlink()
        return alive

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@atexit.register
def _stop_all() -> None:
    for proc in list(_LIVE):
        proc.stop()


class Server(StageProcess):
    """``mmcache serve`` on a free port, healthy when constructed (unless ``wait=False``: then
    call :meth:`wait_healthy`, so that several servers can start at once)."""

    def __init__(
        self,
        model: Path,
        *args: str,
        media_dir: Path | None = None,
        env: dict[str, str] | None = None,
        wait: bool = True,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = ["serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(self.port), *args]
        if media_dir is not None:
            cmd += ["--allowed-local-media-path", str(media_dir)]
        super().__init__(cmd, env)
        if wait:
            self.wait_healthy()

    def wait_healthy(self) -> None:
        """Block until ``/health`` answers 200; stops the server and raises if it never does."""
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            self.check_running()
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        self.tree = descendants(self.proc.pid)
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.3)
        raise RuntimeError(f"mmcache serve did not become healthy:\n{self.log_tail()}")

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as ``{name{labels}: value}``."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as resp:
            text = resp.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                with contextlib.suppress(ValueError):
                    out[name] = float(value)
        return out

    def model_name(self) -> str:
        with urllib.request.urlopen(self.url + "/v1/models", timeout=30) as resp:
            return json.loads(resp.read())["data"][0]["id"]


def metric(metrics: dict[str, float], prefix: str) -> float:
    """Sum of every series whose name (labels included) starts with ``prefix``."""
    return sum(v for k, v in metrics.items() if k == prefix or k.startswith(prefix + "{"))


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
