"""``mmcache serve --kv-store-server``: the shared KV tier's store (Debian's ``redis-server``) as
one more child of the launcher, on a unix socket in the run directory, bounded in memory
(``allkeys-lru``: a full store forgets its least recently used blocks) and never written to disk.
"""

from __future__ import annotations

import shutil
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
