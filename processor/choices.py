"""``n`` choices of one request, sharing one prefill through the LLM stage's prefix cache.

The first choice goes alone; once its first tokens arrive its prompt's full blocks are in the
cache, and the other choices start: their probe routes them to that replica and their prefill
is a prefix hit (only the prompt's last, partial block is computed again).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from processor.dispatch import Dispatcher
from processor.pipeline import Prepared
from shared.messages import GenerateChunk

_DONE = object()


async def choices(dispatcher: Dispatcher, prepared: Prepared) -> AsyncIterator[tuple[int, GenerateChunk]]:
    """(choice index, reply) as they come; leaving early aborts every choice still generating."""
    n = prepared.req.n
    if n == 1:
        async with contextlib.aclosing(dispatcher.generate(prepared)) as replies:
            async for reply in replies:
                yield 0, reply
        return
    first = dispatcher.generate(prepared, 0, stream=True)
    try:
        head = await anext(first)
    except BaseException:
        await first.aclose()
        raise
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, replies: AsyncIterator[GenerateChunk]) -> None:
        try:
            async with contextlib.aclosing(replies):
                async for reply in replies:
                    queue.put_nowait((index, reply))
            queue.put_nowait((index, _DONE))
        except Exception as exc:  # raised to the caller, in order with the replies
            queue.put_nowait((index, exc))

    tasks = [asyncio.ensure_future(pump(0, first))]
    tasks += [asyncio.ensure_future(pump(i, dispatcher.generate(prepared, i))) for i in range(1, n)]
    try:
        yield 0, head
        running = n
        while running:
            index, item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
