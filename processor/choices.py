"""``n`` choices of one request, sharing one prefill through the LLM stage's prefix cache.

The first choice goes alone; once its first tokens arrive its prompt's full blocks are in the
cache, and the other choices start: their probe routes them to that replica and their prefill
is a prefix hit (only the prompt's last, partial block is computed again).

A choice the caller has finished (a stop string in its text) is aborted at its LLM replica as soon
as the caller asks for the next reply, as a single choice is when the caller stops reading.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable

from mmcache.processor.dispatch import Dispatcher
from mmcache.processor.pipeline import Prepared
from mmcache.shared.messages import GenerateReply

_DONE = object()


async def choices(
    dispatcher: Dispatcher, prepared: Prepared, finished: Callable[[int], bool]
) -> AsyncGenerator[tuple[int, GenerateReply], None]:
    """(choice index, reply) as they come; leaving early aborts every choice still generating.

    ``finished(i)``: has the caller done with choice ``i`` (read after each of its replies has
    been handed over)? Such a choice is aborted there and its later replies are not yielded.
    """
    n = prepared.req.n
    if n == 1:
        async with contextlib.aclosing(dispatcher.generate(prepared)) as replies:
            async for reply in replies:
                yield 0, reply
                if finished(0):
                    return  # NOTE: aclosing aborts it at the stage
        return
    first = dispatcher.generate(prepared, 0, stream=True)
    try:
        head = await anext(first)
    except BaseException:
        await first.aclose()
        raise
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, replies: AsyncGenerator[GenerateReply, None]) -> None:
        try:
            async with contextlib.aclosing(replies):
                async for reply in replies:
                    queue.put_nowait((index, reply))
            queue.put_nowait((index, _DONE))
        except Exception as exc:  # raised to the caller, in order with the replies
            queue.put_nowait((index, exc))

    tasks = [asyncio.ensure_future(pump(0, first))]
    tasks += [asyncio.ensure_future(pump(i, dispatcher.generate(prepared, i))) for i in range(1, n)]
    live = set(range(n))  # choices still generating as far as the caller is concerned
    # NOTE: one turn for the pumps to enter ``aclosing``: a task cancelled before it starts would
    # leave choice 0's generator (already started) open, and its generation running.
    await asyncio.sleep(0)

    def settle(index: int) -> None:
        if index in live and finished(index):
            live.discard(index)
            tasks[index].cancel()  # NOTE: closing its generator sends the stage an Abort

    try:
        yield 0, head
        settle(0)
        while live:
            index, item = await queue.get()
            if index not in live:
                continue  # finished by the caller: what it still sent is not part of the answer
            if item is _DONE:
                live.discard(index)
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
                settle(index)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
