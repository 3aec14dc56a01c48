"""The OpenAI-compatible HTTP API (aiohttp)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import orjson
import zmq.asyncio
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from processor.body import load_body
from processor.detokenizer import Detokenizer
from processor.dispatch import Dispatcher
from processor.errors import APIError, error_body, error_middleware
from processor.http_fetch import HttpFetcher, parse_networks
from processor.media_source import MediaSource
from processor.metrics import ProcessorMetrics
from processor.pipeline import Pipeline, Prepared
from processor.preprocess import Preprocessor
from processor.prompt import PromptBuilder
from processor.request import ChatRequest, parse_chat_request
from processor.request_log import RECORD, RequestRecord, request_middleware
from processor.stages import StageClients
from shared.checkpoint import ModelSpec
from shared.config import ProcessorConfig, split_list
from shared.messages import GenerateChunk
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
    app[CONFIG] = cfg
    app[MODEL_NAME] = cfg.served_model_name or spec.name
    app[SLOTS] = asyncio.Semaphore(cfg.max_concurrent_requests)
    pre = Preprocessor(cfg.model, cfg.video_fps, cfg.max_video_frames)
    prompts = PromptBuilder(spec)

    async def resources(app: web.Application):
        ctx = zmq.asyncio.Context()
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
        app[DISPATCHER] = Dispatcher(stages, cfg.stage_timeout)
        yield
        app[PIPELINE].close()
        await http.close()
        stages.close()
        ctx.destroy(linger=0)

    app.cleanup_ctx.append(resources)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def models(request: web.Request) -> web.Response:
    name = request.app[MODEL_NAME]
    card = {"id": name, "object": "model", "created": 0, "owned_by": "mmcache"}
    return web.json_response({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    """Each stage replica, whether it answers, and where Prometheus scrapes it."""
    encoders, llms = await request.app[STAGES].health()
    stages = [*(("encoder", h) for h in encoders), *(("llm", h) for h in llms)]
    ok = all(h.pong is not None for _, h in stages)
    body = {
        "status": "ok" if ok else "unavailable",
        "metrics_url": str(request.url.with_path("/metrics").with_query(None)),
        "stages": [
            {
                "stage": kind,
                "address": h.address,
                "ok": h.pong is not None,
                "error": h.error,
                "load": h.pong.load if h.pong else None,
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
        raise APIError(
            404,
            f"model {req.model!r} does not exist; this server serves {request.app[MODEL_NAME]!r}",
            "model_not_found",
            "model",
        )
    record = request[RECORD]
    record.stream = req.stream
    record.set_salt(req.cache_salt)
    pipeline = request.app[PIPELINE]
    prepared = await pipeline.prepare(req)
    detok = Detokenizer(pipeline.prompts.tokenizer, req.stop)
    completion = _Completion(request.app[MODEL_NAME], req, prepared, record.id)
    generation = request.app[DISPATCHER].generate(prepared)
    try:
        if req.stream:
            return await _stream(request, generation, detok, completion)
        async with contextlib.aclosing(generation):
            async for chunk in generation:
                completion.update(chunk)
                detok.add(chunk.token_ids)
                if detok.stopped:
                    completion.finish_reason = "stop"
                    break
        return web.json_response(completion.body(detok.flush(), detok.token_ids))
    finally:
        completion.fill(record)


async def _stream(
    request: web.Request,
    generation: AsyncIterator[GenerateChunk],
    detok: Detokenizer,
    completion: _Completion,
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
    await _sse(resp, completion.chunk({"role": "assistant", "content": ""}))
    try:
        chunk = first
        while chunk is not None:
            completion.update(chunk)
            detok.add(chunk.token_ids)
            if detok.stopped:
                completion.finish_reason = "stop"
            text = detok.flush() if completion.finish_reason else detok.safe_delta()
            if text:
                await _sse(resp, completion.chunk({"content": text}))
                if record.first_token is None:
                    record.first_token = time.perf_counter()
            if completion.finish_reason:
                break
            chunk = await anext(generation, None)
        await _sse(resp, completion.chunk({}, finish=True))
        if completion.req.include_usage:
            await _sse(resp, completion.usage_chunk())
    except APIError as exc:
        record.code = exc.code  # the status went out as 200 before the stage failed
        await _sse(resp, error_body(exc.status, exc.message, exc.code))
    finally:
        await generation.aclose()
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _sse(resp: web.StreamResponse, payload: dict) -> None:
    await resp.write(b"data: " + orjson.dumps(payload) + b"\n\n")


class _Completion:
    """Accumulates one completion's state and renders OpenAI response shapes."""

    def __init__(self, model: str, req: ChatRequest, prepared: Prepared, completion_id: str):
        self.id = completion_id
        self.created = int(time.time())
        self.model = model
        self.req = req
        self.prepared = prepared
        self.num_prompt_tokens = len(prepared.token_ids)
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self.finish_reason: str | None = None

    def update(self, chunk) -> None:
        self.num_output_tokens += len(chunk.token_ids)
        self.num_cached_tokens = chunk.num_cached_tokens
        if chunk.finish_reason is not None:
            self.finish_reason = "length" if chunk.finish_reason == "length" else "stop"

    def fill(self, record: RequestRecord) -> None:
        """Copy this completion's numbers into its request-log record."""
        record.prompt_tokens = self.num_prompt_tokens
        record.cached_tokens = self.num_cached_tokens
        record.completion_tokens = self.num_output_tokens
        record.mm_cache = self.prepared.report.as_dict()

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_output_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens},
            "mm_cache": self.prepared.report.as_dict(),
        }

    def body(self, text: str, token_ids: list[int]) -> dict:
        choice: dict = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": self.finish_reason or "stop",
            "logprobs": None,
        }
        out = {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(),
        }
        if self.req.return_token_ids:
            choice["token_ids"] = token_ids
            out["prompt_token_ids"] = self.prepared.token_ids
        return out

    def chunk(self, delta: dict, finish: bool = False) -> dict:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "delta": delta,
                    "finish_reason": (self.finish_reason or "stop") if finish else None,
                    "logprobs": None,
                }
            ],
        }

    def usage_chunk(self) -> dict:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": self.usage(),
        }


def run(cfg: ProcessorConfig) -> None:
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
        handler_cancellation=True,
        print=None,
        access_log=None,
        shutdown_timeout=SHUTDOWN_SECONDS,
    )
