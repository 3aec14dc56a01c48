"""Batch chunks from concurrent requests into one vision forward.

Chunks queue up while a forward runs; the next forward takes as many as fit in
``max_batch_tokens`` patches. The forward runs in a worker thread so the event
loop keeps receiving requests and sending replies.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from mmcache.encoder_stage.vision import VisionInput, VisionTower

log = logging.getLogger(__name__)


@dataclass(slots=True)
class BatchStats:
    forwards: int = 0
    chunks: int = 0
    patches: int = 0


@dataclass(slots=True)
class _Pending:
    chunk: VisionInput
    patches: int
    future: asyncio.Future = field(repr=False)


OnForward = Callable[[int, int, float], None]  # (chunks, patches, seconds) of one forward


class Batcher:
    def __init__(self, tower: VisionTower, max_batch_tokens: int, on_forward: OnForward | None = None):
        self._tower = tower
        self._on_forward = on_forward
        self.max_tokens = max_batch_tokens
        self._queue: deque[_Pending] = deque()
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="vision")
        self._worker: asyncio.Task | None = None
        self.stats = BatchStats()

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def encode(self, chunk: VisionInput) -> torch.Tensor:
        """Embeddings of one chunk, computed in the next forward that has room for it."""
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._run())
        future = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(chunk, self._tower.num_patches(chunk), future))
        self._wakeup.set()
        return await future

    def _take_batch(self) -> list[_Pending]:
        batch: list[_Pending] = []
        budget = self.max_tokens
        while self._queue:
            head = self._queue[0]
            if head.future.cancelled():
                self._queue.popleft()
                continue
            # NOTE: a chunk larger than the budget still runs, alone.
            if batch and head.patches > budget:
                break
            batch.append(self._queue.popleft())
            budget -= head.patches
        return batch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while batch := self._take_batch():
                await self._forward(loop, batch)

    async def _forward(self, loop: asyncio.AbstractEventLoop, batch: list[_Pending]) -> None:
        chunks = [p.chunk for p in batch]
        started = time.perf_counter()
        try:
            outputs = await loop.run_in_executor(self._executor, self._tower.encode, chunks)
        except Exception as exc:
            if len(batch) == 1:
                log.warning("vision forward failed: %s", exc)
                if not batch[0].future.done():
                    batch[0].future.set_exception(exc)
                return
            # One bad chunk must not fail its neighbours: retry each alone.
            for pending in batch:
                await self._forward(loop, [pending])
            return
        patches = sum(p.patches for p in batch)
        self.stats.forwards += 1
        self.stats.chunks += len(batch)
        self.stats.patches += patches
        if self._on_forward is not None:
            self._on_forward(len(batch), patches, time.perf_counter() - started)
        for pending, out in zip(batch, outputs, strict=True):
            if not pending.future.done():
                pending.future.set_result(out)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)
