"""The OpenAI-compatible HTTP API (aiohttp)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncGenerator
from pathlib import Path

import zmq
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from mmcache.processor import routes_batches, routes_completions, routes_responses
from mmcache.processor.answers import Answers
from mmcache.processor.app_state import (
    BATCHES,
    CONFIG,
    DISPATCHER,
    ENGINE,
    FILES,
    INTERACTIVE,
    METRICS,
    MODEL_NAME,
    PIPELINE,
    SLOTS,
    STAGES,
    STORE,
    check_model,
    first_reply,
    limited,
    sse_body,
    sse_response,
    unknown_model,
)
from mmcache.processor.batch_jobs import BatchJobs
from mmcache.processor.body import load_body
from mmcache.processor.choices import choices
from mmcache.processor.cors import setup_cors
from mmcache.processor.dispatch import Dispatcher
from mmcache.processor.drain import Drain
from mmcache.processor.errors import APIError, error_middleware
from mmcache.processor.files import FileStore
from mmcache.processor.generation import Engine
from mmcache.processor.http_fetch import HttpFetcher, parse_networks
from mmcache.processor.media_source import MediaSource
from mmcache.processor.metrics import ProcessorMetrics
from mmcache.processor.pipeline import Pipeline
from mmcache.processor.preprocess import Preprocessor
from mmcache.processor.priority import Interactive
from mmcache.processor.prompt import PromptBuilder
from mmcache.processor.request import parse_chat_request
from mmcache.processor.request_log import RECORD, RequestRecord, request_middleware
from mmcache.processor.response_store import ResponseStore
from mmcache.processor.responses import Completion, model_card, sse
from mmcache.processor.stages import StageClients
from mmcache.processor.tokenize import detokenize, tokenize
from mmcache.shared.checkpoint import ModelSpec
from mmcache.shared.config import ProcessorConfig, split_list
from mmcache.shared.messages import GenerateReply
from mmcache.shared.metrics import metrics_url
from mmcache.shared.service import exit_now

log = logging.getLogger(__name__)

SHUTDOWN_SECONDS = 3.0  # in-flight requests get this long to finish on SIGTERM (then are cancelled)


def init(cfg: ProcessorConfig) -> web.Application:
    """Build the app; stage clients and the media fetcher live as long as the app (cleanup_ctx)."""
    spec = ModelSpec.load(cfg.model)
    observed = ProcessorMetrics()

    def request_done(record: RequestRecord) -> None:
        observed.observe(record)
        if PIPELINE in app:
            observed.request_done(lambda: _stats(app))

    drain = Drain(SHUTDOWN_SECONDS)
    app = web.Application(
        client_max_size=cfg.max_request_bytes,
        middlewares=[drain.middleware, error_middleware, request_middleware(request_done)],
    )
    app.on_shutdown.append(drain.on_shutdown)
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
        app[ENGINE] = Engine(app[PIPELINE], app[DISPATCHER], app[MODEL_NAME])
        if cfg.batch_dir:
            answers = Answers(app[ENGINE], app[STORE]).by_path()
            jobs = BatchJobs(
                Path(cfg.batch_dir),
                app[FILES],
                answers,
                app[INTERACTIVE],
                cfg.batch_concurrency,
                cfg.max_batch_lines,
            )
            app[BATCHES] = jobs
            jobs.resume()
        yield
        if BATCHES in app:
            await app[BATCHES].close()
        app[PIPELINE].close()
        await http.close()
        stages.close()
        ctx.destroy(linger=0)

    app[STORE] = ResponseStore(cfg.response_store_entries, cfg.response_store_bytes, cfg.response_store_ttl)
    app.cleanup_ctx.append(resources)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", limited(routes_completions.completions))
    app.router.add_post("/v1/responses", limited(routes_responses.responses))
    app.router.add_post("/tokenize", _tokenize)
    app[INTERACTIVE] = Interactive()
    if cfg.batch_dir:
        app[FILES] = FileStore(Path(cfg.batch_dir))
    routes_batches.add_routes(app)
    app.router.add_post("/detokenize", _detokenize)
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
        raise unknown_model(name, request.app[MODEL_NAME], None)
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
    return await limited(_chat_completions)(request)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    body, held = load_body(await request.read())
    req = parse_chat_request(body, held)
    if req.model != request.app[MODEL_NAME]:
        raise unknown_model(req.model, request.app[MODEL_NAME], "model")
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
    first = await first_reply(generation)
    record = request[RECORD]
    resp = await sse_response(request)
    for choice in completion.choices:
        await sse(resp, completion.chunk(choice, {"role": "assistant", "content": ""}))
    async with sse_body(resp, generation, record):
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
    return resp


async def _tokenize(request: web.Request) -> web.Response:
    body, held = load_body(await request.read())
    if isinstance(body, dict) and body.get("model") is not None:
        check_model(request, body["model"])
    out = await tokenize(request.app[ENGINE], body, held, await _max_model_len(request.app))
    return web.json_response(out)


async def _detokenize(request: web.Request) -> web.Response:
    body, _ = load_body(await request.read())
    if isinstance(body, dict) and body.get("model") is not None:
        check_model(request, body["model"])
    return web.json_response(detokenize(request.app[ENGINE], body))


async def _max_model_len(app: web.Application) -> int:
    """The LLM stage's context (its replicas' smallest), as their last health answers say."""
    _, llms = await app[STAGES].health()
    lens = [h.pong.max_model_len for h in llms if h.pong and h.pong.max_model_len]
    if not lens:
        raise APIError(503, "no LLM replica answers", "stage_unavailable")
    return min(lens)


def run(cfg: ProcessorConfig) -> None:
    if cfg.workers > 1:
        from mmcache.processor.workers import run_workers

        raise SystemExit(run_workers(cfg))
    serve(cfg)


def serve(cfg: ProcessorConfig, reuse_port: bool = False) -> None:
    """One processor process; with ``reuse_port`` it shares the port with its sibling workers."""
    from mmcache.shared.logs import setup_logging
    from mmcache.shared.metrics import setup_metrics
    from mmcache.shared.torch_utils import set_threads

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
    exit_now()
