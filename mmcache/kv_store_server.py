"""Debian's ``redis-server`` as the shared KV tier's store, run by mmcache itself.

``mmcache serve --kv-store-server`` starts one (:func:`start`) as one more child of the launcher,
on a unix socket in the run directory, bounded in memory (``allkeys-lru``: a full store forgets
its least recently used blocks) and never written to disk. :class:`RedisServer` is one on a free
loopback port, for tests and benchmarks: killed and restarted on the same port on demand.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import redis

START_TIMEOUT = 10.0
DEFAULT_MB = 1024


def command(socket_path: Path, max_mb: int) -> list[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError(
            "--kv-store-server needs redis-server (apt-get install redis-server; see scripts/setup)"
        )
    return [
        binary,
        "--port", "0",  # no TCP: only this machine's stages reach it, through the socket
        "--unixsocket", str(socket_path),
        "--unixsocketperm", "700",
        "--save", "",
        "--appendonly", "no",
        "--maxmemory", f"{max_mb}mb",
        "--maxmemory-policy", "allkeys-lru",
    ]  # fmt: skip


def start(socket_path: Path, max_mb: int, preexec_fn: Callable[[], None] | None = None) -> subprocess.Popen:
    """Start the store and wait until it answers (at most :data:`START_TIMEOUT` seconds)."""
    proc = subprocess.Popen(command(socket_path, max_mb), stdout=subprocess.DEVNULL, preexec_fn=preexec_fn)
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with code {proc.returncode}")
        if socket_path.exists():
            try:
                with redis.Redis(unix_socket_path=str(socket_path), socket_timeout=1) as client:
                    if client.ping():
                        return proc
            except redis.ConnectionError:
                pass
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"redis-server did not answer on {socket_path} in {START_TIMEOUT:.0f} s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, *extra: str):
        self.port = free_port()
        self.extra = extra
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        cmd = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        self.proc = subprocess.Popen([*cmd, *self.extra], stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"redis-server exited with {self.proc.returncode}"
            try:
                if self.client().ping():
                    return self
            except redis.ConnectionError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def client(self) -> redis.Redis:
        return redis.Redis("127.0.0.1", self.port, socket_timeout=5)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
