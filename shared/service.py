"""Run one stage process: a ROUTER server until SIGINT/SIGTERM, one zmq context per process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import zmq

from mmcache.shared.logs import setup_logging
from mmcache.shared.metrics import MetricsServer, setup_metrics
from mmcache.shared.rpc import Handler, QuickHandler, Responder, RpcServer

log = logging.getLogger(__name__)

Closer = Callable[[], Awaitable[None] | None]

_replica_id = ""


def replica_id() -> str:
    """This process's id, sent in every Pong: ``MMCACHE_REPLICA_ID``, else host name and bound
    address (a container's or pod's host name is its own; the address tells apart replicas that
    share a host). Empty before :func:`serve` binds."""
    return _replica_id


async def serve(
    name: str,
    bind: str,
    make_handler: Callable[[zmq.Context], Awaitable[tuple[Handler, QuickHandler, Closer]]],
) -> None:
    """Bind ``bind``, answer requests with the handlers from ``make_handler`` until a signal arrives.

    ``make_handler`` returns the request handler, the quick handler (answers what needs no
    waiting as it arrives, see :class:`RpcServer`) and a close function (plain or async) for its
    resources.
    """
    ctx = zmq.Context()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    handler, quick, close = await make_handler(ctx)
    server = RpcServer(ctx, bind, handler, name, quick)
    global _replica_id
    _replica_id = os.environ.get("MMCACHE_REPLICA_ID") or f"{socket.gethostname()}/{server.address}"
    log.info("%s ready on %s (pid %d, replica %s)", name, server.address, os.getpid(), _replica_id)
    serving = loop.create_task(server.serve_forever())
    stopping = loop.create_task(stop.wait())
    await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    log.info("%s stopping", name)
    for task in (serving, stopping):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    server.close()
    closed = close()
    if closed is not None:
        await closed
    ctx.destroy(linger=0)


class StageService(Protocol):
    """What :func:`with_metrics_server` needs of a stage's service."""

    metrics: Any  # its prometheus families, in ``metrics.registry``
    metrics_server: MetricsServer | None  # read by its Pong, which reports the port

    async def handle(self, msg: Any, reply: Responder) -> None: ...

    def quick(self, msg: Any, reply: Responder) -> bool: ...

    def close(self) -> None: ...


async def with_metrics_server(service: StageService, port: int) -> tuple[Handler, QuickHandler, Closer]:
    """``service``'s handlers for :func:`serve`, its ``/metrics`` served on ``port`` meanwhile;
    the close function closes the service, then that server."""
    metrics = service.metrics_server = await MetricsServer.start(service.metrics.registry, port)

    async def close() -> None:
        service.close()
        await metrics.close()

    return service.handle, service.quick, close


def run_stage(name: str, bind: str, torch_threads: int, make_handler, log_format: str = "text") -> None:
    """The body of ``mmcache encoder|llm``: logging, CPU threads, then :func:`serve` until a signal."""
    from mmcache.shared.torch_utils import set_threads

    setup_logging(name, log_format)
    setup_metrics()
    set_threads(torch_threads)
    asyncio.run(serve(name, bind, make_handler))
    exit_now()


def exit_now() -> None:
    """End a stage process whose resources are already closed, skipping interpreter finalization.

    Tearing down torch, transformers and their many objects took ~2 s of a stop on a loaded
    2-core machine (measured with py-spy: the main thread busy with no Python frame left), time
    an orchestrator's grace period does not have. Everything that needs closing was closed by
    then; logs and standard streams are flushed here.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)
