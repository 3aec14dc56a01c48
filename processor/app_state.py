"""What the processor's HTTP handlers share: the application's keys (its config, stage clients,
engine, stores), the bound on requests in progress, the model check, and the frame of a streamed
answer (its first reply taken before the 200, the event-stream response, its errors and close)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

from mmcache.processor.batch_jobs import BatchJobs
from mmcache.processor.dispatch import Dispatcher
from mmcache.processor.errors import APIError, bad_request, error_body
from mmcache.processor.files import FileStore
from mmcache.processor.generation import Engine
from mmcache.processor.metrics import ProcessorMetrics
from mmcache.processor.pipeline import Pipeline
from mmcache.processor.priority import Interactive
from mmcache.processor.request_log import RequestRecord
from mmcache.processor.response_store import ResponseStore
from mmcache.processor.responses import SSE_DONE, sse
from mmcache.processor.stages import StageClients
from mmcache.shared.config import ProcessorConfig
from mmcache.shared.messages import GenerateReply

CONFIG = web.AppKey("config", ProcessorConfig)
PIPELINE = web.AppKey("pipeline", Pipeline)
DISPATCHER = web.AppKey("dispatcher", Dispatcher)
STAGES = web.AppKey("stages", StageClients)
MODEL_NAME = web.AppKey("model_name", str)
SLOTS = web.AppKey("slots", asyncio.Semaphore)
METRICS = web.AppKey("metrics", ProcessorMetrics)
ENGINE = web.AppKey("engine", Engine)
STORE = web.AppKey("response_store", ResponseStore)
INTERACTIVE = web.AppKey("interactive", Interactive)
FILES = web.AppKey("files", FileStore)
BATCHES = web.AppKey("batches", BatchJobs)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def limited(handler: Handler) -> Handler:
    """``handler`` within the processor's bound on requests in progress (503 past it)."""

    async def limited_handler(request: web.Request) -> web.StreamResponse:
        slots = request.app[SLOTS]
        if slots.locked():
            raise APIError(503, "too many requests in progress, retry later", "overloaded")
        running = request.app[METRICS].running
        interactive = request.app[INTERACTIVE]
        async with slots:
            running.inc()
            interactive.enter()
            try:
                return await handler(request)
            finally:
                interactive.leave()
                running.dec()

    return limited_handler


def check_model(request: web.Request, name: Any) -> None:
    served = request.app[MODEL_NAME]
    if not isinstance(name, str) or not name:
        raise bad_request("'model' is required and must be a string", "missing_model", "model")
    if name != served:
        raise unknown_model(name, served, "model")


async def first_reply(
    generation: AsyncGenerator[tuple[int, GenerateReply], None],
) -> tuple[int, GenerateReply] | None:
    """A stream's first reply, taken before the 200 is sent, so stage errors still become a JSON
    4xx/5xx; the generation is closed if that fails."""
    try:
        return await anext(generation, None)
    except BaseException:
        await generation.aclose()
        raise


async def sse_response(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


@contextlib.asynccontextmanager
async def sse_body(
    resp: web.StreamResponse,
    generation: AsyncGenerator[tuple[int, GenerateReply], None],
    record: RequestRecord,
) -> AsyncIterator[None]:
    """Around a streamed chat or text completion's chunks: a stage error inside becomes an error
    event (the 200 is already out), the generation is closed whatever happens, and a stream that
    ended, by its last reply or by that event, gets the closing ``[DONE]``."""
    try:
        yield
    except APIError as exc:
        record.code = exc.code  # the status went out as 200 before the stage failed
        await sse(resp, error_body(exc.status, exc.message, exc.code))
    finally:
        await generation.aclose()
    await resp.write(SSE_DONE)
    await resp.write_eof()


def unknown_model(name: str, served: str, param: str | None) -> APIError:
    return APIError(
        404, f"model {name!r} does not exist; this server serves {served!r}", "model_not_found", param
    )
