"""Interactive requests first: batch lines start only while no interactive request is running.

NOTE: the LLM stage schedules first come, first served and knows no priority, so the processor
holds batch lines back instead: a line already running goes on, but no new one starts while an
interactive request is in progress (under steady interactive load a batch waits).
"""

from __future__ import annotations

import asyncio


class Interactive:
    """How many interactive requests are in progress, and a way to wait for none."""

    def __init__(self) -> None:
        self.running = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.running += 1
        self._idle.clear()

    def leave(self) -> None:
        self.running -= 1
        if self.running == 0:
            self._idle.set()

    async def idle(self) -> None:
        """Return once no interactive request is in progress."""
        while self.running:
            await self._idle.wait()
