"""Drain on SIGTERM: in-flight requests get a grace period, then their handlers are cancelled.

aiohttp's own shutdown waits ``shutdown_timeout`` for a handler, then again as long for the
cancelled request, before it force-closes: a stream of many tokens could hold a processor's
stop for twice the timeout, past an orchestrator's grace. Here the app keeps its handler tasks
and, in ``on_shutdown`` (after the listening sockets are closed), waits at most ``grace`` seconds
for them and cancels the rest. A cancelled generation aborts its LLM request as a client that
left does, so the stages it used are free at once and the client's stream ends.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

log = logging.getLogger(__name__)

CANCEL_WAIT_SECONDS = 1.0  # how long cancelled handlers get to run their cleanup


class Drain:
    """The app's in-flight handler tasks, and its ``on_shutdown`` hook."""

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self.tasks: set[asyncio.Task] = set()

    @web.middleware
    async def middleware(self, request: web.Request, handler) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            return await handler(request)
        finally:
            self.tasks.discard(task)

    async def on_shutdown(self, _app: web.Application) -> None:
        pending = set(self.tasks)
        if not pending:
            return
        _done, pending = await asyncio.wait(pending, timeout=self.grace)
        if not pending:
            return
        log.warning(
            "shutting down: cancelling %d request(s) still running after %.1f s", len(pending), self.grace
        )
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=CANCEL_WAIT_SECONDS)
