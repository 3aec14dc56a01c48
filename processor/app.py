"""The OpenAI-compatible HTTP API (aiohttp)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import zmq
from aiohttp import BodyPartReader, web
from prometheus_client import CONTENT_TYPE_LATEST

from mmcache.processor.answers import Answers
from mmcache.processor.batch_jobs import BatchJobs
from mmcache.processor.body import load_body
from mmcache.processor.choices import choices
from mmcache.processor.completions import CompletionsAnswer, parse_completions
from mmcache.processor.cors import setup_cors
from mmcache.processor.dispatch import Dispatcher
from mmcache.processor.drain import Drain
from mmcache.processor.errors import APIError, bad_request, error_body, error_middleware
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
from mmcache.processor.responses import SSE_DONE, Completion, model_card, sse
from mmcache.processor.responses_api import ResponseRender, parse_responses
from mmcache.processor.stages import StageClients
from mmcache.processor.tokenize import detokenize, tokenize
from mmcache.shared.checkpoint import ModelSpec
from mmcache.shared.config import ProcessorConfig, split_list
from mmcache.shared.messages import GenerateReply
from mmcache.shared.metrics import metrics_url
from mmcache.shared.service import exit_now

log = logging.getLogger(__name__)

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
UPLOAD_CHUNK = 1 << 20
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
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
    app.router.add_post("/v1/completions", limited(_completions))
    app.router.add_post("/v1/responses", limited(_responses))
    app.router.add_post("/tokenize", _tokenize)
    app[INTERACTIVE] = Interactive()
    if cfg.batch_dir:
        app[FILES] = FileStore(Path(cfg.batch_dir))
    app.router.add_post("/v1/files", _upload)
    app.router.add_get("/v1/files/{file_id}", _file)
    app.router.add_get("/v1/files/{file_id}/content", _file_content)
    app.router.add_post("/v1/batches", _create_batch)
    app.router.add_get("/v1/batches", _list_batches)
    app.router.add_get("/v1/batches/{batch_id}", _batch)
    app.router.add_post("/v1/batches/{batch_id}/cancel", _cancel_batch)
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


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await limited(_chat_completions)(request)


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
    first = await _first_reply(generation)
    record = request[RECORD]
    resp = await _sse_response(request)
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


def _check_model(request: web.Request, name: Any) -> None:
    served = request.app[MODEL_NAME]
    if not isinstance(name, str) or not name:
        raise bad_request("'model' is required and must be a string", "missing_model", "model")
    if name != served:
        raise _unknown_model(name, served, "model")


async def _completions(request: web.Request) -> web.StreamResponse:
    body, _ = load_body(await request.read())
    engine = request.app[ENGINE]
    req = parse_completions(body, engine.tokenizer)
    _check_model(request, body.get("model"))
    record = request[RECORD]
    record.stream = req.chat.stream
    record.set_salt(req.chat.cache_salt)
    answer = CompletionsAnswer(engine, req, "cmpl-" + record.id.removeprefix("chatcmpl-"))
    if not req.chat.stream:
        out = await answer.run()
        _fill(record, out["usage"])
        return web.json_response(out)
    completion = await answer.start(0)
    try:
        return await _stream_completions(request, answer, completion)
    finally:
        engine.done(completion.prepared)
        completion.fill(record)


async def _stream_completions(
    request: web.Request, answer: CompletionsAnswer, completion: Completion
) -> web.StreamResponse:
    generation = request.app[ENGINE].generation(completion)
    first = await _first_reply(generation)
    resp = await _sse_response(request)
    record = request[RECORD]
    sent = [0] * len(completion.choices)  # logprob entries streamed, per choice
    try:
        if answer.req.echo:
            prompt = request.app[ENGINE].tokenizer.decode(completion.prepared.token_ids)
            for choice in completion.choices:
                await sse(resp, answer.chunk(choice.index, prompt, None, None))
        item = first
        while item is not None:
            choice = completion.choices[item[0]]
            if choice.finish_reason is None:
                choice.update(item[1])
                final = choice.finish_reason is not None
                text = choice.detok.flush() if final else choice.detok.safe_delta()
                logprobs = None
                if answer.req.logprobs is not None:
                    new = choice.logprobs[sent[choice.index] :]
                    sent[choice.index] = len(choice.logprobs)
                    logprobs = _legacy_entries(new)
                if text or final or (logprobs and logprobs["tokens"]):
                    finish = choice.openai_finish_reason if final else None
                    await sse(resp, answer.chunk(choice.index, text, finish, logprobs))
                    if record.first_token is None:
                        record.first_token = time.perf_counter()
            if completion.done:
                break
            item = await anext(generation, None)
        if answer.req.chat.include_usage:
            await sse(resp, {**answer.chunk(0, "", None, None), "choices": [], "usage": answer.usage()})
    except APIError as exc:
        record.code = exc.code
        await sse(resp, error_body(exc.status, exc.message, exc.code))
    finally:
        await generation.aclose()
    await resp.write(SSE_DONE)
    await resp.write_eof()
    return resp


def _legacy_entries(entries: list[dict]) -> dict:
    tokens = [e["token"] for e in entries]
    return {
        "tokens": tokens,
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))],
    }


def _fill(record: RequestRecord, usage: dict) -> None:
    record.prompt_tokens = usage["prompt_tokens"]
    record.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
    record.completion_tokens = usage["completion_tokens"]


async def _first_reply(
    generation: AsyncGenerator[tuple[int, GenerateReply], None],
) -> tuple[int, GenerateReply] | None:
    """A stream's first reply, taken before the 200 is sent, so stage errors still become a JSON
    4xx/5xx; the generation is closed if that fails."""
    try:
        return await anext(generation, None)
    except BaseException:
        await generation.aclose()
        raise


async def _sse_response(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


async def _responses(request: web.Request) -> web.StreamResponse:
    body, held = load_body(await request.read())
    req = parse_responses(body, held, request.app[STORE])
    _check_model(request, req.chat.model)
    if req.chat.n != 1:
        raise bad_request("a response has one answer", "unsupported_parameter", "n")
    engine = request.app[ENGINE]
    record = request[RECORD]
    record.stream = req.chat.stream
    record.set_salt(req.chat.cache_salt)
    prepared = await engine.prepare(req.chat)
    completion = Completion(engine.model, req.chat, prepared, engine.tokenizer, record.id)
    render = ResponseRender(req, completion, engine.model, "resp_" + record.id.removeprefix("chatcmpl-"))
    try:
        if not req.chat.stream:
            await engine.run(completion)
            return web.json_response(render.final(request.app[STORE]))
        return await _stream_response(request, render)
    finally:
        engine.done(prepared)
        completion.fill(record)


async def _stream_response(request: web.Request, render: ResponseRender) -> web.StreamResponse:
    """The Responses event sequence; text streams as it comes, unless tools may be called (then
    the output items come at the end, once the model's blocks can be told from text)."""
    completion = render.completion
    generation = request.app[ENGINE].generation(completion)
    first = await _first_reply(generation)
    resp = await _sse_response(request)
    record = request[RECORD]

    async def emit(kind: str, **fields) -> None:
        event = render.event(kind, **fields)
        await resp.write(f"event: {kind}\n".encode() + b"data: " + orjson.dumps(event) + b"\n\n")

    live = completion.req.tools is None  # text deltas as they come
    text = ""
    message_open = False
    item_id = render.message_id

    async def open_message() -> None:
        nonlocal message_open
        message_open = True
        await emit(
            "response.output_item.added", output_index=0, item=render.message_item(None, "in_progress")
        )
        await emit(
            "response.content_part.added",
            item_id=item_id,
            output_index=0,
            content_index=0,
            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
        )

    try:
        await emit("response.created", response=render.response("in_progress", [], usage=False))
        await emit("response.in_progress", response=render.response("in_progress", [], usage=False))
        choice = completion.choices[0]
        item = first
        while item is not None:
            choice.update(item[1])
            if live:
                delta = choice.detok.flush() if choice.finish_reason else choice.detok.safe_delta()
                if delta:
                    if not message_open:
                        await open_message()
                    text += delta
                    await emit(
                        "response.output_text.delta",
                        item_id=item_id,
                        output_index=0,
                        content_index=0,
                        delta=delta,
                        logprobs=[],
                    )
                    if record.first_token is None:
                        record.first_token = time.perf_counter()
            if completion.done:
                break
            item = await anext(generation, None)
        if live:
            render.streamed = text + choice.detok.flush()
        final = render.final(request.app[STORE])
        items = final["output"]
        for index, out in enumerate(items):
            if out["type"] == "message":
                body = out["content"][0]["text"]
                if not message_open:
                    await open_message()
                    if body:
                        await emit(
                            "response.output_text.delta",
                            item_id=item_id,
                            output_index=index,
                            content_index=0,
                            delta=body,
                            logprobs=[],
                        )
                await emit(
                    "response.output_text.done",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    text=body,
                    logprobs=[],
                )
                await emit(
                    "response.content_part.done",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    part=out["content"][0],
                )
            else:
                await emit(
                    "response.output_item.added",
                    output_index=index,
                    item={**out, "arguments": "", "status": "in_progress"},
                )
                await emit(
                    "response.function_call_arguments.delta",
                    item_id=out["id"],
                    output_index=index,
                    delta=out["arguments"],
                )
                await emit(
                    "response.function_call_arguments.done",
                    item_id=out["id"],
                    name=out["name"],
                    output_index=index,
                    arguments=out["arguments"],
                )
            await emit("response.output_item.done", output_index=index, item=out)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        await emit(kind, response=final)
    except APIError as exc:
        record.code = exc.code
        await emit("error", code=exc.code, message=exc.message, param=exc.param)
    finally:
        await generation.aclose()
    await resp.write_eof()
    return resp


async def _tokenize(request: web.Request) -> web.Response:
    body, held = load_body(await request.read())
    if isinstance(body, dict) and body.get("model") is not None:
        _check_model(request, body["model"])
    out = await tokenize(request.app[ENGINE], body, held, await _max_model_len(request.app))
    return web.json_response(out)


async def _detokenize(request: web.Request) -> web.Response:
    body, _ = load_body(await request.read())
    if isinstance(body, dict) and body.get("model") is not None:
        _check_model(request, body["model"])
    return web.json_response(detokenize(request.app[ENGINE], body))


async def _max_model_len(app: web.Application) -> int:
    """The LLM stage's context (its replicas' smallest), as their last health answers say."""
    _, llms = await app[STAGES].health()
    lens = [h.pong.max_model_len for h in llms if h.pong and h.pong.max_model_len]
    if not lens:
        raise APIError(503, "no LLM replica answers", "stage_unavailable")
    return min(lens)


def _files(request: web.Request) -> FileStore:
    if FILES not in request.app:
        raise APIError(
            404, "batch jobs are off: start the processor with --batch-dir DIR", "batches_disabled"
        )
    return request.app[FILES]


def _jobs(request: web.Request) -> BatchJobs:
    _files(request)
    return request.app[BATCHES]


async def _upload(request: web.Request) -> web.Response:
    """``multipart/form-data`` with ``purpose`` (batch) and ``file``, streamed to disk (bounded)."""
    files = _files(request)
    limit = request.app[CONFIG].max_request_bytes
    if not request.content_type.startswith("multipart/"):
        raise bad_request("send the file as multipart/form-data (purpose, file)", "invalid_content_type")
    reader = await request.multipart()
    purpose = filename = None
    file_id = files.new_id()
    part_path = files.partial(file_id)
    try:
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                raise bad_request("nested multipart bodies are not supported", "invalid_content_type")
            if part.name == "purpose":
                purpose = (await part.read(decode=True)).decode()
            elif part.name == "file":
                filename = part.filename or "upload.jsonl"
                size = 0
                with open(part_path, "wb") as out:
                    while chunk := await part.read_chunk(UPLOAD_CHUNK):
                        size += len(chunk)
                        if size > limit:
                            raise APIError(
                                413, f"file is larger than the limit of {limit} bytes", "request_too_large"
                            )
                        out.write(chunk)
        if purpose != "batch":
            raise bad_request("'purpose' must be batch", "invalid_purpose", "purpose")
        if filename is None:
            raise bad_request("'file' is required", "missing_file", "file")
        return web.json_response(files.commit(file_id, filename, purpose))
    finally:
        part_path.unlink(missing_ok=True)


async def _file(request: web.Request) -> web.Response:
    return web.json_response(_files(request).info(request.match_info["file_id"]))


async def _file_content(request: web.Request) -> web.FileResponse:
    path = _files(request).path(request.match_info["file_id"])
    return web.FileResponse(path, headers={"Content-Type": "application/jsonl"})


async def _create_batch(request: web.Request) -> web.Response:
    jobs = _jobs(request)
    body, _ = load_body(await request.read())
    return web.json_response(jobs.create(body))


async def _list_batches(request: web.Request) -> web.Response:
    data = _jobs(request).recent()
    return web.json_response({"object": "list", "data": data, "has_more": False})


async def _batch(request: web.Request) -> web.Response:
    return web.json_response(_jobs(request).get(request.match_info["batch_id"]))


async def _cancel_batch(request: web.Request) -> web.Response:
    return web.json_response(_jobs(request).cancel(request.match_info["batch_id"]))


def _unknown_model(name: str, served: str, param: str | None) -> APIError:
    return APIError(
        404, f"model {name!r} does not exist; this server serves {served!r}", "model_not_found", param
    )


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
