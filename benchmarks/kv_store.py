"""Candidate stores for the shared KV tier on loopback: Redis (Debian ``redis-server``) against
Mooncake Store (PyPI ``mooncake-transfer-engine-non-cuda``, TCP transport).

For each value size (32 KiB .. 1 MiB, the size of one KV block of a small to a mid checkpoint)
one client puts then gets ``--ops`` values, one call at a time (the latency a loader waits for),
then gets them again as one batch (the throughput of loading a prefix). It reports the median and
p90 latency per call, MB/s, the server's resident memory per stored byte (Redis: the server's RSS
grows with what it holds; Mooncake: the client mounts a fixed segment up front, the master holds
only metadata), and how long the server takes to start. Every server is started here on free
loopback ports and stopped at the end; a candidate that is not installed is skipped.

    python -m mmcache.benchmarks.kv_store [--ops 64] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

SIZES = (32 << 10, 128 << 10, 512 << 10, 1 << 20)
START_TIMEOUT = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, timeout: float = START_TIMEOUT) -> float:
    """Seconds until ``port`` accepts a connection."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return time.perf_counter() - started
        except OSError:
            time.sleep(0.01)
    raise RuntimeError(f"port {port} not ready in {timeout} s")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@dataclass(frozen=True, slots=True)
class Client:
    put: Callable[[str, bytes], None]
    get: Callable[[str], bytes | None]
    get_many: Callable[[list[str]], list[bytes | None]]
    server_pid: int
    start_s: float


@contextmanager
def redis_client() -> Iterator[Client]:
    import redis

    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        start_s = wait_port(port, proc)
        r = redis.Redis("127.0.0.1", port, socket_timeout=5)
        yield Client(r.set, r.get, lambda keys: r.mget(keys), proc.pid, start_s)
        r.close()
    finally:
        proc.terminate()
        proc.wait(10)


@contextmanager
def mooncake_client() -> Iterator[Client]:
    from mooncake.store import MooncakeDistributedStore

    port, http = free_port(), free_port()
    proc = subprocess.Popen(
        [
            "mooncake_master",
            f"--port={port}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_port={http}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        start_s = wait_port(port, proc)
        wait_port(http, proc)
        store = MooncakeDistributedStore()
        rc = store.setup(
            "127.0.0.1",
            f"http://127.0.0.1:{http}/metadata",
            512 << 20,
            128 << 20,
            "tcp",
            "",
            f"127.0.0.1:{port}",
        )
        if rc != 0:
            raise RuntimeError(f"mooncake setup returned {rc}")

        def get(key: str) -> bytes | None:
            value = store.get(key)
            return value or None

        def put(key: str, value: bytes) -> None:
            if store.put(key, value) != 0:
                raise RuntimeError("mooncake put failed")

        yield Client(put, get, lambda keys: store.get_batch(keys), proc.pid, start_s)
        store.close()
    finally:
        proc.terminate()
        proc.wait(10)


def run_one(name: str, make, ops: int) -> list[dict]:
    rows = []
    with make() as client:
        base_rss = rss_bytes(client.server_pid)
        stored = 0
        for size in SIZES:
            value = os.urandom(size)
            keys = [f"{name}-{size}-{i}" for i in range(ops)]
            puts, gets = [], []
            for key in keys:
                t = time.perf_counter()
                client.put(key, value)
                puts.append(time.perf_counter() - t)
            stored += size * ops
            for key in keys:
                t = time.perf_counter()
                got = client.get(key)
                gets.append(time.perf_counter() - t)
                assert got is not None and len(got) == size, (name, size, None if got is None else len(got))
            t = time.perf_counter()
            batch = client.get_many(keys)
            batch_s = time.perf_counter() - t
            assert all(v is not None and len(v) == size for v in batch)
            rows.append(
                {
                    "store": name,
                    "size_kib": size >> 10,
                    "put_p50_ms": statistics.median(puts) * 1e3,
                    "put_p90_ms": sorted(puts)[int(0.9 * len(puts))] * 1e3,
                    "get_p50_ms": statistics.median(gets) * 1e3,
                    "get_p90_ms": sorted(gets)[int(0.9 * len(gets))] * 1e3,
                    "put_MBps": size * ops / sum(puts) / 1e6,
                    "get_MBps": size * ops / sum(gets) / 1e6,
                    "batch_get_MBps": size * ops / batch_s / 1e6,
                    "server_rss_per_stored_byte": (rss_bytes(client.server_pid) - base_rss) / stored,
                    "start_s": client.start_s,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ops", type=int, default=64, help="values per size (bounded: at most 256)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per store (at most 10)")
    args = parser.parse_args(argv)
    ops, repeat = min(max(args.ops, 4), 256), min(max(args.repeat, 1), 10)
    candidates = []
    if shutil.which("redis-server"):
        candidates.append(("redis", redis_client))
    if shutil.which("mooncake_master"):
        candidates.append(("mooncake", mooncake_client))
    print(f"# load average before: {os.getloadavg()}", file=sys.stderr)
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # servers may write files (logs, dumps) into their working directory
        for _ in range(repeat):
            for name, make in candidates:  # interleaved: both see the same noise
                results += run_one(name, make, ops)
    cols = ["put_p50_ms", "put_p90_ms", "get_p50_ms", "get_p90_ms", "put_MBps", "get_MBps", "batch_get_MBps"]
    print("store     KiB  " + "  ".join(f"{c:>16}" for c in cols) + "  rss/byte  start_s")
    for name, _ in candidates:
        for size in SIZES:
            rs = [r for r in results if r["store"] == name and r["size_kib"] == size >> 10]
            cells = []
            for c in cols:
                vals = [r[c] for r in rs]
                cells.append(f"{statistics.median(vals):7.2f} [{min(vals):.2f}-{max(vals):.2f}]".rjust(16))
            rss = statistics.median(r["server_rss_per_stored_byte"] for r in rs)
            start = statistics.median(r["start_s"] for r in rs)
            print(f"{name:8} {size >> 10:5}  " + "  ".join(cells) + f"  {rss:8.2f}  {start:7.3f}")
    print(f"# load average after: {os.getloadavg()}; {repeat} runs x {ops} values per size", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
