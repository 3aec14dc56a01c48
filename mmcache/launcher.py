"""``mmcache serve``: the three stages as separate processes on one machine, over ipc sockets.

The launcher owns its children: they die with it (PR_SET_PDEATHSIG), a child
that exits early stops the rest, and SIGINT/SIGTERM stop all of them
(SIGTERM, then SIGKILL after a grace period). Nothing is left behind.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mmcache import kv_store_server
from mmcache.placement import STAGES, Placement, place, weight_bytes
from mmcache.shared.config import (
    EncoderConfig,
    LLMConfig,
    ProcessorConfig,
    add_arguments,
    from_args,
    to_flags,
)

log = logging.getLogger("mmcache.serve")

# Chosen by the launcher, not by a flag: the stages' addresses, and their metrics ports (any free
# port each; the processor's /health lists where they are).
_ADDRESS_FIELDS = {"bind", "encoder", "llm", "metrics_port"}
GRACE_SECONDS = 10.0


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    for cls in (ProcessorConfig, EncoderConfig, LLMConfig):
        add_arguments(parser, cls, skip=_ADDRESS_FIELDS)
    parser.add_argument(
        "--kv-store-server",
        action="store_true",
        default=os.environ.get("MMCACHE_KV_STORE_SERVER", "") in ("1", "true", "yes", "on"),
        help="also run the shared KV tier's store (redis-server, on a unix socket) and point the LLM "
        "stage at it; off by default: one replica's own pool already holds its prefixes "
        "[env MMCACHE_KV_STORE_SERVER]",
    )
    parser.add_argument(
        "--kv-store-server-mb",
        type=int,
        default=int(os.environ.get("MMCACHE_KV_STORE_SERVER_MB", kv_store_server.DEFAULT_MB)),
        help="memory of that store, MiB (least recently used blocks go first) "
        "[env MMCACHE_KV_STORE_SERVER_MB]",
    )
    for stage in STAGES:
        parser.add_argument(
            f"--{stage}-threads",
            type=int,
            default=None,
            metavar="N",
            help=f"torch threads of the {stage} stage alone (overrides --torch-threads for it; "
            "default: see docs/performance.md, thread placement)",
        )


def default_model_dir() -> Path:
    home = Path(os.environ.get("MMCACHE_HOME", Path.home() / ".cache" / "mmcache"))
    return home / "tiny-qwen2-vl"


def ensure_default_model() -> Path:
    path = default_model_dir()
    if not (path / "config.json").is_file():
        from mmcache.tiny_model import make_tiny_model

        log.info("generating the default tiny checkpoint in %s", path)
        make_tiny_model(path)
    return path


def _placement(args: argparse.Namespace, model: str | None = None) -> Placement:
    """Threads per stage (:mod:`mmcache.placement`) for the checkpoint in ``model``: the busy
    stages get the cores (one each for a model too small to split), unless
    ``--torch-threads`` (or MMCACHE_TORCH_THREADS, or OMP_NUM_THREADS) or a stage's own
    ``--<stage>-threads`` says otherwise."""
    every = args.torch_threads
    # NOTE: an environment that sets OMP_NUM_THREADS (the test harness: 1) has said how many
    # threads each process takes; the placement would otherwise override it with set_num_threads.
    for name in ("MMCACHE_TORCH_THREADS", "OMP_NUM_THREADS"):
        if every is None and os.environ.get(name, "").strip():
            every = int(os.environ[name])
    per_stage = {stage: getattr(args, f"{stage}_threads", None) for stage in STAGES}
    for stage, n in per_stage.items():
        if n is not None and n < 1:
            raise ValueError(f"--{stage}-threads must be >= 1, got {n}")
    size = weight_bytes(model) if model else None
    return place(len(os.sched_getaffinity(0)), dict(os.environ), every, per_stage, size)


def die_with_parent() -> None:
    """In a child before exec: get SIGTERM when the parent dies (Linux PR_SET_PDEATHSIG)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=os.environ.get("MMCACHE_LOG_LEVEL", "INFO"), format="%(asctime)s serve %(message)s"
    )
    model = args.model or os.environ.get("MMCACHE_MODEL") or str(ensure_default_model())
    rundir = Path(tempfile.mkdtemp(prefix="mmcache-"))
    enc_addr, llm_addr = f"ipc://{rundir}/encoder.sock", f"ipc://{rundir}/llm.sock"
    placement = _placement(args, model)
    threads = placement.threads
    children: dict[str, subprocess.Popen] = {}
    store_url: dict[str, str] = {}
    if args.kv_store_server and not args.kv_store:
        socket_path = rundir / "kv.sock"
        children["kvstore"] = kv_store_server.start(socket_path, args.kv_store_server_mb, die_with_parent)
        store_url["kv_store"] = f"unix://{socket_path}"
    processor = from_args(
        ProcessorConfig, args, model=model, encoder=enc_addr, llm=llm_addr, torch_threads=threads["processor"]
    )
    configs: dict[str, object] = {
        "encoder": from_args(
            EncoderConfig, args, model=model, bind=enc_addr, metrics_port=0, torch_threads=threads["encoder"]
        ),
        "llm": from_args(
            LLMConfig,
            args,
            model=model,
            bind=llm_addr,
            metrics_port=0,
            torch_threads=threads["llm"],
            **store_url,
        ),
        "processor": processor,
    }
    stop = {"signal": 0}

    def on_signal(signum, _frame) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    env = {k: v for k, v in os.environ.items() if k != "MMCACHE_METRICS_PORT"} | placement.env
    try:
        for name, cfg in configs.items():
            cmd = [sys.executable, "-m", "mmcache", name, *to_flags(cfg)]
            children[name] = subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent)
        log.info(
            "mmcache serving %s on http://%s:%d (pids %s; torch threads %s)",
            model,
            processor.host,
            processor.port,
            {n: p.pid for n, p in children.items()},
            threads,
        )
        while not stop["signal"]:
            for name, proc in list(children.items()):
                if proc.poll() is None:
                    continue
                if name == "kvstore":  # NOTE: the LLM stage computes without its store; serving goes on
                    log.error("the KV store exited with code %s; serving without it", proc.returncode)
                    del children[name]
                    continue
                log.error("%s exited with code %s; stopping", name, proc.returncode)
                return 1
            time.sleep(0.2)
        return 0
    finally:
        _stop_all(children)
        shutil.rmtree(rundir, ignore_errors=True)


def _stop_all(children: dict[str, subprocess.Popen]) -> None:
    """The processor first (it finishes or ends its streams), then the stages it talks to."""
    order = [["processor"], ["encoder", "llm"], ["kvstore"]]
    for names in order:
        procs = {n: children[n] for n in names if n in children}
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + GRACE_SECONDS
        for name, proc in procs.items():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s of SIGTERM; killing it", name, GRACE_SECONDS)
                proc.kill()
                proc.wait()
