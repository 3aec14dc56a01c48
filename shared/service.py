"""Run one stage process: a ROUTER server until SIGINT/SIGTERM, one zmq context per process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable

import zmq

from shared.rpc import Handler, QuickHandler, RpcServer

log = logging.getLogger(__name__)

Closer = Callable[[], None]

_replica_id = ""


def replica_id() -> str:
    """This process's id, sent in every Pong: ``MMCACHE_REPLICA_ID``, else host name and bound
    address (a container's or pod's host name is its own; the address tells apart replicas that
    share a host). Empty before :func:`serve` binds."""
    return _replica_id


def setup_logging(stage: str) -> None:
    level = os.environ.get("MMCACHE_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format=f"%(asctime)s {stage} %(levelname)s %(name)s: %(message)s")


async def serve(
    name: str,
    bind: str,
    make_handler: Callable[[zmq.Context], Awaitable[tuple[Handler, QuickHandler, Closer]]],
) -> None:
    """Bind ``bind``, answer requests with the handlers from ``make_handler`` until a signal arrives.

    ``make_handler`` returns the request handler, the quick handler (answers what needs no
    waiting as it arrives, see :class:`RpcServer`) and a close function for its resources.
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
    close()
    ctx.destroy(linger=0)


def run_stage(name: str, bind: str, torch_threads: int, make_handler) -> None:
    """The body of ``mmcache encoder|llm``: logging, CPU threads, then :func:`serve` until a signal."""
    from shared.torch_utils import set_threads

    setup_logging(name)
    set_threads(torch_threads)
    asyncio.run(serve(name, bind, make_handler))
