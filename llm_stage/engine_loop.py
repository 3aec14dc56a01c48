"""The supervised engine loop: steps the engine in its worker thread whenever there is news.

It sleeps on :attr:`EngineLoop.wakeup` (set by whoever sends the engine a command) with the
scheduler's next deadline (a pin's expiry) as timeout, never a fixed poll. While a step runs
the event loop must not touch the engine's state: calls that need it (a probe, a pin release)
go through :meth:`EngineLoop.between_steps` and run as soon as the step ends.

A step whose model call fails is the engine's to handle (it fails that step's sequences and
stays consistent). Any other failure, in a step or in the loop itself, means the engine can
no longer be trusted: the loop stops, :attr:`EngineLoop.healthy` turns False for good and
``distrusted`` is told once, so the replica can end its requests and leave routing instead of
answering its heartbeat while nothing steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from mmcache.llm_stage.engine import Engine, StepResult
from mmcache.llm_stage.metrics import LLMMetrics

log = logging.getLogger(__name__)

MAX_DEFERRED = 4096  # calls waiting for the running step to end


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        metrics: LLMMetrics,
        deliver: Callable[[StepResult], None],
        distrusted: Callable[[str], None],
    ):
        self.engine = engine
        self.metrics = metrics
        self._deliver = deliver  # a step's outputs, fetches and admissions, to the live requests
        self._distrusted = distrusted
        self.wakeup = asyncio.Event()
        self.healthy = True
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._task: asyncio.Task | None = None
        self._stepping = False
        self._deferred: list[Callable[[], None]] = []

    def start(self) -> None:
        if self._task is None and self.healthy:
            self._task = asyncio.get_running_loop().create_task(self._run())
            self._task.add_done_callback(self._ended)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def between_steps(self, call: Callable[[], None]) -> bool:
        """Run ``call`` now, or once the running step has ended; False if too many wait already
        (the caller refuses, or leaves a pin to its expiry)."""
        if not self._stepping:
            call()
        elif len(self._deferred) < MAX_DEFERRED:
            self._deferred.append(call)
        else:
            return False
        return True

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        idle = False
        while self.healthy:
            if idle or not self.engine.has_work():
                await self._news()
                if not self.engine.has_work() and not self._due():
                    # NOTE: woken only to take a new deadline (a pin): no step. Nothing can come
                    # between the check and the clear: commands are sent from this thread.
                    self.wakeup.clear()
                    idle = False
                    continue
            self.wakeup.clear()  # NOTE: before the step, so nothing sent during it is missed
            started = time.perf_counter()
            self._stepping = True
            try:
                result = await loop.run_in_executor(self._executor, self.engine.step)
            except Exception as exc:
                self._distrust(f"an engine step failed: {type(exc).__name__}: {exc}", exc)
                return
            finally:
                self._stepping = False
                self._run_deferred()
            self.metrics.step(started, time.perf_counter(), result.outputs, result.computed)
            self._deliver(result)
            idle = not result.computed and not result.outputs

    async def _news(self) -> None:
        """Until a command may have come (a request, rows, a cancel) or the next pin expires."""
        deadline = self.engine.next_deadline()
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self.wakeup.wait()

    def _due(self) -> bool:
        deadline = self.engine.next_deadline()
        return deadline is not None and deadline <= time.monotonic()

    def _run_deferred(self) -> None:
        calls, self._deferred = self._deferred, []
        for call in calls:
            call()

    def _ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and (exc := task.exception()) is not None:
            self._distrust(f"the engine loop failed: {type(exc).__name__}: {exc}", exc)

    def _distrust(self, why: str, exc: BaseException) -> None:
        if not self.healthy:
            return
        self.healthy = False
        log.error("%s; this replica stops serving", why, exc_info=exc)
        self._distrusted(why)
        self._run_deferred()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)
