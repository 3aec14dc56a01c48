"""Single flight: concurrent callers asking for one key share one computation."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SingleFlight(Generic[K, V]):
    """At most one computation per key at a time; later callers for the key await the first.

    NOTE: the computation runs as its own task, so a cancelled caller (a client gone) does not
    fail the others waiting on the same key. A failure reaches every waiter and is not kept: the
    next caller computes again.
    """

    def __init__(self) -> None:
        self._inflight: dict[K, asyncio.Task[V]] = {}

    def __contains__(self, key: K) -> bool:
        return key in self._inflight

    async def run(self, key: K, make: Callable[[], Awaitable[V]]) -> tuple[V, bool]:
        """The value for ``key`` and whether this call started its computation."""
        task = self._inflight.get(key)
        owner = task is None
        if task is None:
            task = asyncio.get_running_loop().create_task(self._make(key, make))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # never "unretrieved"
            self._inflight[key] = task
        try:
            return await asyncio.shield(task), owner
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and (current is None or not current.cancelling()):
                # NOTE: the computation was cancelled, not this caller: a failure, not a cancel
                # (a caller that takes it for its own would end silently).
                raise RuntimeError(f"the computation for {key!r} was cancelled") from None
            raise

    async def _make(self, key: K, make: Callable[[], Awaitable[V]]) -> V:
        try:
            return await make()
        finally:
            self._inflight.pop(key, None)
