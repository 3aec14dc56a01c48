"""Interactive requests first: batch lines run only while no interactive request is running.

NOTE: the LLM stage schedules first come, first served and knows no priority, so the processor
keeps batch lines out of the way instead: no line starts while an interactive request is in
progress, and a running line is preempted (aborted, to run again later) when one arrives.
"""

from __future__ import annotations

import asyncio


class Interactive:
    """How many interactive requests are in progress, and a way to wait for none."""

    def __init__(self) -> None:
        self.running = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._busy = asyncio.Event()

    def enter(self) -> None:
        self.running += 1
        self._idle.clear()
        self._busy.set()

    def leave(self) -> None:
        self.running -= 1
        if self.running == 0:
            self._busy.clear()
            self._idle.set()

    async def busy(self) -> None:
        """Return once an interactive request is in progress."""
        while not self.running:
            await self._busy.wait()

    async def idle(self) -> None:
        """Return once no interactive request is in progress."""
        while self.running:
            await self._idle.wait()
