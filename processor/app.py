"""The OpenAI-compatible HTTP API (aiohttp)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator

import zmq
from aiohttp import web

from processor.body import load_body
from processor.choices import choices
from processor.cors import setup_cors
from processor.dispatch import Dispatcher
from processor.errors import APIError, error_body, error_middleware
from processor.http_fetch import HttpFetcher, parse_networks
from processor.media_source import MediaSource
from processor.pipeline import Pipeline, Prepared
from processor.preprocess import Preprocessor
from processor.prompt import PromptBuilder
from processor.request import parse_chat_request
from processor.responses import SSE_DONE, Completion, model_card, sse
from processor.stages import StageClients
from shared.checkpoint import ModelSpec
from shared.config import ProcessorConfig, split_list
from shared.messages import GenerateChunk

log = logging.getLogger(__name__)

CONFIG = web.AppKey("config", ProcessorConfig)
PIPELINE = web.AppKey("pipeline", Pipeline)
DISPATCHER = web.AppKey("dispatcher", Dispatcher)
STAGES = web.AppKey("stages", StageClients)
MODEL_NAME = web.AppKey("model_name", str)
SLOTS = web.AppKey("slots", asyncio.Semaphore)
SHUTDOWN_SECONDS = 3.0  # in-flight requests get this long to finish on SIGTERM


def init(cfg: ProcessorConfig) -> web.Application:
    """Build the app; stage clients and the media fetcher live as long as the app (cleanup_ctx)."""
    spec = ModelSpec.load(cfg.model)
    app = web.Application(client_max_size=cfg.max_request_bytes, middlewares=[error_middleware])
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
        "worker": os.getpid(),  # which of the `--workers` processes answered
        "stages": [
            {
                "stage": kind,
                "address": h.address,
                "ok": h.pong is not None,
                "error": h.error,
                "load": h.pong.load if h.pong else None,
            }
            for kind, h in stages
        ],
    }
    return web.json_response(body, status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text: the processor's own counters, then each stage replica's (from its Pong)."""
    cache = request.app[PIPELINE].cache
    dispatcher = request.app[DISPATCHER]
    lines = [
        f"mmcache_processor_file_reads_total {request.app[PIPELINE].source.file_reads}",
        f"mmcache_processor_cache_hits_total {cache.stats.hits}",
        f"mmcache_processor_cache_misses_total {cache.stats.misses}",
        f"mmcache_processor_decodes_total {cache.stats.decodes}",
        f"mmcache_processor_cache_evictions_total {cache.stats.evictions}",
        f"mmcache_processor_cache_bytes {cache.nbytes}",
        f"mmcache_processor_cache_capacity_bytes {cache.capacity}",
        f"mmcache_processor_cache_entries {len(cache)}",
        f"mmcache_processor_repairs_total {dispatcher.num_repairs}",
        f'mmcache_processor_failover_retries_total{{stage="llm"}} {dispatcher.num_llm_retries}',
        f'mmcache_processor_failover_retries_total{{stage="encoder"}} {dispatcher.num_encoder_retries}',
        f'mmcache_processor_failover_migrations_total{{stage="llm"}} {dispatcher.num_llm_migrations}',
        f"mmcache_processor_failover_exhausted_total {dispatcher.num_failover_exhausted}",
    ]
    encoders, llms = await request.app[STAGES].health()
    for stage, replicas in (("encoder", encoders), ("llm", llms)):
        for h in replicas:
            label = f'{{address="{h.address}"}}'
            lines.append(f"mmcache_{stage}_up{label} {int(h.pong is not None)}")
            if h.pong is None:
                continue
            lines.append(f"mmcache_{stage}_load{label} {h.pong.load}")
            for name, value in sorted(h.pong.info.items()):
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    lines.append(f"mmcache_{stage}_{name}{label} {value}")
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    slots = request.app[SLOTS]
    if slots.locked():
        raise APIError(503, "too many requests in progress, retry later", "overloaded")
    async with slots:
        return await _chat_completions(request)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    body, held = load_body(await request.read())
    req = parse_chat_request(body, held)
    if req.model != request.app[MODEL_NAME]:
        raise _unknown_model(req.model, request.app[MODEL_NAME], "model")
    pipeline = request.app[PIPELINE]
    prepared = await pipeline.prepare(req)
    try:
        return await _respond(request, prepared)
    finally:
        pipeline.done(prepared)


async def _respond(request: web.Request, prepared: Prepared) -> web.StreamResponse:
    req = prepared.req
    completion = Completion(request.app[MODEL_NAME], req, prepared, request.app[PIPELINE].prompts.tokenizer)
    generation = choices(request.app[DISPATCHER], prepared)
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
    generation: AsyncIterator[tuple[int, GenerateChunk]],
    completion: Completion,
) -> web.StreamResponse:
    # The first reply comes before the 200 is sent, so stage errors still become a JSON 4xx/5xx.
    try:
        first = await anext(generation, None)
    except BaseException:
        await generation.aclose()
        raise
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    for choice in completion.choices:
        await sse(resp, completion.chunk(choice, {"role": "assistant", "content": ""}))
    try:
        item = first
        while item is not None:
            choice = completion.choices[item[0]]
            if choice.finish_reason is None:
                choice.update(item[1])
                delta = choice.delta()
                if delta:
                    await sse(resp, completion.chunk(choice, delta))
                if choice.finish_reason is not None:
                    await sse(resp, completion.chunk(choice, {}, finish=True))
            if completion.done:
                break
            item = await anext(generation, None)
        if completion.req.include_usage:
            await sse(resp, completion.usage_chunk())
    except APIError as exc:
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
    from shared.service import setup_logging
    from shared.torch_utils import set_threads

    setup_logging("processor")
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
