"""The OpenAI-compatible HTTP API (aiohttp)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncGenerator

import zmq
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from processor.body import load_body
from processor.choices import choices
from processor.cors import setup_cors
from processor.dispatch import Dispatcher
from processor.errors import APIError, error_body, error_middleware
from processor.http_fetch import HttpFetcher, parse_networks
from processor.media_source import MediaSource
from processor.metrics import ProcessorMetrics
from processor.pipeline import Pipeline
from processor.preprocess import Preprocessor
from processor.prompt import PromptBuilder
from processor.request import parse_chat_request
from processor.request_log import RECORD, RequestRecord, request_middleware
from processor.responses import SSE_DONE, Completion, model_card, sse
from processor.stages import StageClients
from shared.checkpoint import ModelSpec
from shared.config import ProcessorConfig, split_list
from shared.messages import GenerateReply
from shared.metrics import metrics_url

log = logging.getLogger(__name__)

CONFIG = web.AppKey("config", ProcessorConfig)
PIPELINE = web.AppKey("pipeline", Pipeline)
DISPATCHER = web.AppKey("dispatcher", Dispatcher)
STAGES = web.AppKey("stages", StageClients)
MODEL_NAME = web.AppKey("model_name", str)
SLOTS = web.AppKey("slots", asyncio.Semaphore)
METRICS = web.AppKey("metrics", ProcessorMetrics)
SHUTDOWN_SECONDS = 3.0  # in-flight requests get this long to finish on SIGTERM


def init(cfg: ProcessorConfig) -> web.Application:
    """Build the app; stage clients and the media fetcher live as long as the app (cleanup_ctx)."""
    spec = ModelSpec.load(cfg.model)
    observed = ProcessorMetrics()

    def request_done(record: RequestRecord) -> None:
        observed.observe(record)
        if PIPELINE in app:
            observed.request_done(lambda: _stats(app))

    app = web.Application(
        client_max_size=cfg.max_request_bytes,
        middlewares=[error_middleware, request_middleware(request_done)],
    )
    app[METRICS] = observed
    if cfg.allowed_origins:
        setup_cors(app, split_list(cfg.allowed_origins))
    app[CONFIG] = cfg
    app[MODEL_NAME] = cfg.served_model_name or spec.name
    app[SLOTS] = asyncio.Semaphore(cfg.max_concurrent_requests)
    pre = Preprocessor(cfg.model, cfg.video_fps, cfg.max_video_frames)
    prompts = PromptBuilder(spec)

    async def resources(app: web.Application):
        ctx = zmq.Context()
        stages = StageClients(ctx, split_list(cfg.encoder), split_list(cfg.llm))
        http = HttpFetcher(
            parse_networks(split_list(cfg.allowed_media_networks)),
            cfg.max_media_bytes,
            cfg.media_fetch_timeout,
            cfg.max_media_redirects,
        )
        source = MediaSource(cfg.allowed_dirs, cfg.max_media_bytes, http)
        app[STAGES] = stages
        app[PIPELINE] = Pipeline(cfg, source, pre, prompts)
        app[DISPATCHER] = Dispatcher(stages, cfg.stage_timeout, cfg.max_failovers)
        yield
        app[PIPELINE].close()
        await http.close()
        stages.close()
        ctx.destroy(linger=0)

    app.cleanup_ctx.append(resources)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)  # ids may contain "/"
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [model_card(request.app[MODEL_NAME])]})


async def model(request: web.Request) -> web.Response:
    name = request.match_info["model"]
    if name != request.app[MODEL_NAME]:
        raise _unknown_model(name, request.app[MODEL_NAME], None)
    return web.json_response(model_card(name))


async def health(request: web.Request) -> web.Response:
    """200 when every replica found answers; with ``?ready=1``, when each tier has one that does
    (can serve: what container health checks and readiness probes ask, so a replica that is still
    starting or has died does not take the processor out too)."""
    encoders, llms = await request.app[STAGES].health()
    stages = [*(("encoder", h) for h in encoders), *(("llm", h) for h in llms)]
    up = [h.pong is not None for _, h in stages]
    # NOTE: a tier whose name resolves to no replica yet is never healthy.
    if request.query.get("ready"):
        ok = any(h.pong for h in encoders) and any(h.pong for h in llms)
    else:
        ok = bool(encoders) and bool(llms) and all(up)
    body = {
        "status": "ok" if ok else "unavailable",
        "metrics_url": str(request.url.with_path("/metrics").with_query(None)),
        "worker": os.getpid(),  # which of the `--workers` processes answered
        "stages": [
            {
                "stage": kind,
                "address": h.address,
                "ok": h.pong is not None,
                "error": h.error,
                "load": h.pong.load if h.pong else None,
                "id": h.pong.id if h.pong else None,
                "counters": h.pong.info if h.pong else None,  # as of its last answer (for people)
                "metrics_url": metrics_url(h.address, h.pong.info.get("metrics_port")) if h.pong else None,
            }
            for kind, h in stages
        ],
    }
    return web.json_response(body, status=200 if ok else 503)


def _stats(app: web.Application) -> dict:
    return {**app[PIPELINE].stats(), **app[DISPATCHER].stats()}


async def metrics(request: web.Request) -> web.Response:
    """This processor's metrics (every worker's, in multiprocess mode); each stage replica serves
    its own on its metrics port (see /health)."""
    observed = request.app[METRICS]
    observed.sync(_stats(request.app))
    return web.Response(body=observed.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def chat_completions(request: web.Request) -> web.StreamResponse:
    slots = request.app[SLOTS]
    if slots.locked():
        raise APIError(503, "too many requests in progress, retry later", "overloaded")
    running = request.app[METRICS].running
    async with slots:
        running.inc()
        try:
            return await _chat_completions(request)
        finally:
            running.dec()


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    body, held = load_body(await request.read())
    req = parse_chat_request(body, held)
    if req.model != request.app[MODEL_NAME]:
        raise _unknown_model(req.model, request.app[MODEL_NAME], "model")
    record = request[RECORD]
    record.stream = req.stream
    record.set_salt(req.cache_salt)
    pipeline = request.app[PIPELINE]
    prepared = await pipeline.prepare(req)
    completion = Completion(request.app[MODEL_NAME], req, prepared, pipeline.prompts.tokenizer, record.id)
    try:
        return await _respond(request, completion)
    finally:
        pipeline.done(prepared)
        completion.fill(record)


async def _respond(request: web.Request, completion: Completion) -> web.StreamResponse:
    req = completion.req
    generation = choices(
        request.app[DISPATCHER],
        completion.prepared,
        lambda i: completion.choices[i].finish_reason is not None,
    )
    if req.stream:
        return await _stream(request, generation, completion)
    async with contextlib.aclosing(generation):
        async for index, chunk in generation:
            completion.choices[index].update(chunk)
            if completion.done:
                break  # a stop string ended the last choice: the stage need not go on
    return web.json_response(completion.body())


async def _stream(
    request: web.Request,
    generation: AsyncGenerator[tuple[int, GenerateReply], None],
    completion: Completion,
) -> web.StreamResponse:
    # The first reply comes before the 200 is sent, so stage errors still become a JSON 4xx/5xx.
    try:
        first = await anext(generation, None)
    except BaseException:
        await generation.aclose()
        raise
    record = request[RECORD]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    for choice in completion.choices:
        await sse(resp, completion.chunk(choice, {"role": "assistant", "content": ""}))
    try:
        record = request[RECORD]
        item = first
        while item is not None:
            choice = completion.choices[item[0]]
            if choice.finish_reason is None:
                choice.update(item[1])
                for delta in choice.deltas():
                    await sse(resp, completion.chunk(choice, delta))
                    if record.first_token is None:
                        record.first_token = time.perf_counter()
                if choice.finish_reason is not None:
                    await sse(resp, completion.chunk(choice, {}, finish=True))
            if completion.done:
                break
            item = await anext(generation, None)
        if completion.req.include_usage:
            await sse(resp, completion.usage_chunk())
    except APIError as exc:
        request[RECORD].code = exc.code  # the status went out as 200 before the stage failed
        await sse(resp, error_body(exc.status, exc.message, exc.code))
    finally:
        await generation.aclose()
    await resp.write(SSE_DONE)
    await resp.write_eof()
    return resp


def _unknown_model(name: str, served: str, param: str | None) -> APIError:
    return APIError(
        404, f"model {name!r} does not exist; this server serves {served!r}", "model_not_found", param
    )


def run(cfg: ProcessorConfig) -> None:
    if cfg.workers > 1:
        from processor.workers import run_workers

        raise SystemExit(run_workers(cfg))
    serve(cfg)


def serve(cfg: ProcessorConfig, reuse_port: bool = False) -> None:
    """One processor process; with ``reuse_port`` it shares the port with its sibling workers."""
    from shared.logs import setup_logging
    from shared.metrics import setup_metrics
    from shared.torch_utils import set_threads

    setup_logging("processor", cfg.log_format)
    setup_metrics()
    set_threads(cfg.torch_threads)
    web.run_app(
        init(cfg),
        host=cfg.host,
        port=cfg.port,
        reuse_port=reuse_port or None,
        handler_cancellation=True,
        print=None,
        access_log=None,
        shutdown_timeout=SHUTDOWN_SECONDS,
    )
