"""Start ``mmcache serve`` as a real process tree for end-to-end tests, and make sure it is gone after."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

STARTUP_TIMEOUT = 180.0


def stage_env() -> dict[str, str]:
    """The environment of every stage process the e2e tests start: quiet, one torch thread."""
    return {**os.environ, "MMCACHE_LOG_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, procs: list[subprocess.Popen], timeout: float = STARTUP_TIMEOUT) -> None:
    """Until ``url``/health answers 200; fails at once if one of ``procs`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(map(str, proc.args[2:4]))} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
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


class Server:
    """``mmcache serve`` on a free port; ``stop()`` checks that no process is left behind."""

    def __init__(self, model: Path, *args: str, media_dir: Path | None = None, log: Path | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model
        cmd = [
            sys.executable,
            "-m",
            "mmcache",
            "serve",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *args,
        ]
        if media_dir is not None:
            cmd += ["--allowed-local-media-path", str(media_dir)]
        env = stage_env()
        self._log = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.children: set[int] = set()
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        try:
            wait_healthy(self.url, [self.proc])
        except RuntimeError:
            self.stop()
            raise
        self.children = descendants(self.proc.pid)

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

    def stop(self) -> set[int]:
        """SIGTERM the launcher, wait, and return any process of the tree still alive."""
        tree = self.children | descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        deadline = time.monotonic() + 10
        left = {pid for pid in tree if Path(f"/proc/{pid}").exists()}
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = {pid for pid in left if alive(pid)}
        for pid in left:  # never leak processes into the next test, even when the test fails
            os.kill(pid, signal.SIGKILL)
        if self._log is not subprocess.DEVNULL:
            self._log.close()
        return left


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
