"""Real mmcache processes for tests and benchmarks: ``mmcache serve`` (or one stage) as a child
process tree that is always stopped — by :meth:`StageProcess.stop`, at interpreter exit, or by
the kernel when this process dies (PR_SET_PDEATHSIG) — and checked to leave nothing behind.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from mmcache.launcher import die_with_parent
from mmcache.scrape import Samples, scrape_deployment

STARTUP_TIMEOUT = 180.0
STOP_TIMEOUT = 30.0


def stage_env(**extra: str) -> dict[str, str]:
    """The environment of the stage processes end-to-end tests start: quiet, one torch thread."""
    return {**os.environ, "MMCACHE_LOG_LEVEL": "WARNING", "OMP_NUM_THREADS": "1", **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(proc: subprocess.Popen) -> str:
    """``encoder --model`` of ``python -m mmcache encoder --model ...``."""
    args = proc.args
    return " ".join(map(str, args[2:4])) if isinstance(args, list) else str(args)


def wait_healthy(url: str, procs: Sequence[subprocess.Popen], timeout: float = STARTUP_TIMEOUT) -> None:
    """Until ``url``/health answers 200; fails at once if one of ``procs`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{_command(proc)} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not become healthy in {timeout:.0f} s")


def descendants(pid: int) -> set[int]:
    """All live descendants of ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if fields[0] == "Z":
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


_LIVE: set[StageProcess] = set()


class StageProcess:
    """``python -m module args`` with its output in a log file (or ``log``)."""

    def __init__(
        self,
        args: Sequence[str],
        env: dict[str, str] | None = None,
        module: str = "mmcache",
        log: Path | None = None,
    ):
        self._own_log = log is None
        self.log_path = log or Path(tempfile.mkstemp(prefix="mmcache-", suffix=".log")[1])
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            env={**os.environ, "MMCACHE_LOG_LEVEL": "WARNING", **(env or {})},
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
        """SIGTERM, wait, SIGKILL what is left of the tree; returns the pids that had to be killed."""
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
        left = {pid for pid in tree if alive(pid)}
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = {pid for pid in left if alive(pid)}
        for pid in left:  # never leak processes, even when the caller failed
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._log.close()
        if self._own_log:
            with contextlib.suppress(OSError):
                self.log_path.unlink()
        return left

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@atexit.register
def _stop_all() -> None:
    for proc in list(_LIVE):
        proc.stop()


class Server(StageProcess):
    """``mmcache serve`` on a free port, healthy when constructed (unless ``wait=False``: then call
    :meth:`wait_healthy`, so that several servers can start at once)."""

    def __init__(
        self,
        model: Path,
        *args: str,
        media_dir: Path | None = None,
        env: dict[str, str] | None = None,
        log: Path | None = None,
        wait: bool = True,
    ):
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = ["serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(self.port), *args]
        if media_dir is not None:
            cmd += ["--allowed-local-media-path", str(media_dir)]
        super().__init__(cmd, env, log=log)
        if wait:
            self.wait_healthy()

    @property
    def children(self) -> set[int]:
        return self.tree

    def wait_healthy(self) -> None:
        """Block until ``/health`` answers 200; stops the server and raises if it never does."""
        try:
            wait_healthy(self.url, [self.proc])
        except BaseException as exc:
            tail = self.log_tail()
            self.stop()
            if isinstance(exc, RuntimeError):
                raise RuntimeError(f"{exc}\n{tail}") from exc
            raise
        self.tree = descendants(self.proc.pid)

    def post(self, path: str, body: object, timeout: float = 120) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"{}")

    def get(self, path: str, timeout: float = 30) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"{}")

    def metrics(self) -> Samples:
        """Every sample of the processor and of each stage replica (found through /health)."""
        return scrape_deployment(self.url)

    def model_name(self) -> str:
        return self.get("/v1/models")[1]["data"][0]["id"]
