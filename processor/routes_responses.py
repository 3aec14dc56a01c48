"""``POST /v1/responses``: the Responses API, answered whole or as its event sequence."""

from __future__ import annotations

import time

import orjson
from aiohttp import web

from mmcache.processor.app_state import ENGINE, STORE, check_model, first_reply, sse_response
from mmcache.processor.body import load_body
from mmcache.processor.errors import APIError, bad_request
from mmcache.processor.request_log import RECORD
from mmcache.processor.responses import Completion
from mmcache.processor.responses_api import parse_responses
from mmcache.processor.responses_render import ResponseRender


async def responses(request: web.Request) -> web.StreamResponse:
    body, held = load_body(await request.read())
    req = parse_responses(body, held, request.app[STORE])
    check_model(request, req.chat.model)
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
    first = await first_reply(generation)
    resp = await sse_response(request)
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
