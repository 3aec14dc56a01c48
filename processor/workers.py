"""``mmcache processor --workers N``: N processor processes on one HTTP port.

Each worker is a whole processor (its own event loop, caches and stage clients) listening with
SO_REUSEPORT, so the kernel spreads incoming connections across them and one core's Python is no
longer the ceiling. Routing stays consistent: every worker discovers the same replicas and
computes the same rendezvous owners. This parent only starts the workers, passes SIGTERM/SIGINT
on, and stops them all when one exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import tempfile

from mmcache.shared.config import ProcessorConfig

log = logging.getLogger("mmcache.processor.workers")

GRACE_SECONDS = 10.0  # a worker that has not stopped this long after SIGTERM is killed
_PR_SET_PDEATHSIG = 1


def _worker(cfg: ProcessorConfig) -> None:
    # NOTE: a worker dies with its parent, even one killed with SIGKILL: no orphan keeps the port.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    from mmcache.processor.app import serve

    serve(cfg, reuse_port=True)


def run_workers(cfg: ProcessorConfig) -> int:
    """Run ``cfg.workers`` processors until a signal or until one exits; the exit status.

    NOTE: the workers share one metrics directory (prometheus_client's multiprocess mode), so a
    scrape of any worker reports all of them: ``PROMETHEUS_MULTIPROC_DIR`` when set, else a fresh
    one that lives as long as this parent.
    """
    from mmcache.shared.logs import setup_logging

    setup_logging("processor", cfg.log_format)
    with contextlib.ExitStack() as stack:
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = stack.enter_context(
                tempfile.TemporaryDirectory(prefix="mmcache-metrics-")
            )
        return _supervise(cfg)


def _supervise(cfg: ProcessorConfig) -> int:
    from prometheus_client import multiprocess

    one = dataclasses.replace(cfg, workers=1)
    spawn = multiprocessing.get_context("spawn")
    procs = [spawn.Process(target=_worker, args=(one,), name=f"processor-{i}") for i in range(cfg.workers)]
    stopping = False

    def stop(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    for p in procs:
        p.start()
    log.info("%d processor workers on port %d: pids %s", len(procs), cfg.port, [p.pid for p in procs])
    status = 0
    while not stopping:
        done = multiprocessing.connection.wait([p.sentinel for p in procs], timeout=0.2)
        if done:
            exited = next(p for p in procs if p.sentinel in done)
            status = exited.exitcode or 0
            log.warning("worker %s exited with %s: stopping the others", exited.pid, exited.exitcode)
            break
    for p in procs:
        if p.is_alive():
            p.terminate()  # SIGTERM: aiohttp's graceful shutdown
    for p in procs:
        p.join(GRACE_SECONDS)
        if p.is_alive():
            p.kill()
            p.join()
        multiprocess.mark_process_dead(p.pid)
    return status
