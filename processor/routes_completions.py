"""``POST /v1/completions``: the legacy text-completion API, answered whole or streamed."""

from __future__ import annotations

import time

from aiohttp import web

from mmcache.processor.app_state import ENGINE, check_model, first_reply, sse_body, sse_response
from mmcache.processor.body import load_body
from mmcache.processor.completions import CompletionsAnswer, parse_completions
from mmcache.processor.request_log import RECORD, RequestRecord
from mmcache.processor.responses import Completion, sse


async def completions(request: web.Request) -> web.StreamResponse:
    body, _ = load_body(await request.read())
    engine = request.app[ENGINE]
    req = parse_completions(body, engine.tokenizer)
    check_model(request, body.get("model"))
    record = request[RECORD]
    record.stream = req.chat.stream
    record.set_salt(req.chat.cache_salt)
    answer = CompletionsAnswer(engine, req, "cmpl-" + record.id.removeprefix("chatcmpl-"))
    if not req.chat.stream:
        out = await answer.run()
        fill_usage(record, out["usage"])
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
    first = await first_reply(generation)
    resp = await sse_response(request)
    record = request[RECORD]
    sent = [0] * len(completion.choices)  # logprob entries streamed, per choice
    async with sse_body(resp, generation, record):
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
    return resp


def _legacy_entries(entries: list[dict]) -> dict:
    tokens = [e["token"] for e in entries]
    return {
        "tokens": tokens,
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))],
    }


def fill_usage(record: RequestRecord, usage: dict) -> None:
    record.prompt_tokens = usage["prompt_tokens"]
    record.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
    record.completion_tokens = usage["completion_tokens"]
