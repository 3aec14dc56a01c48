"""The request's tools through the chat template; CORS preflights."""

from __future__ import annotations

import pytest
from aiohttp import web

from mmcache.processor.cors import setup_cors
from mmcache.processor.errors import APIError, error_middleware
from mmcache.processor.prompt import PromptBuilder
from mmcache.processor.request import parse_chat_request
from mmcache.shared.checkpoint import ModelSpec


async def hello(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


def app(origins: list[str] | None) -> web.Application:
    application = web.Application(middlewares=[error_middleware])
    if origins:
        setup_cors(application, origins)
    application.router.add_post("/v1/x", hello)
    return application


PREFLIGHT = {"Origin": "https://a.example", "Access-Control-Request-Method": "POST"}


async def test_cors_is_off_by_default(aiohttp_client) -> None:
    client = await aiohttp_client(app(None))
    resp = await client.options("/v1/x", headers=PREFLIGHT)
    assert resp.status == 405
    body = await resp.json()
    assert body["error"]["type"] == "invalid_request_error"  # a 405 is the client's error
    resp = await client.post("/v1/x", headers={"Origin": "https://a.example"})
    assert "Access-Control-Allow-Origin" not in resp.headers


async def test_cors_star_allows_any_origin(aiohttp_client) -> None:
    client = await aiohttp_client(app(["*"]))
    resp = await client.options(
        "/v1/x", headers={**PREFLIGHT, "Access-Control-Request-Headers": "authorization"}
    )
    assert resp.status == 204
    assert resp.headers["Access-Control-Allow-Origin"] == "*"
    assert resp.headers["Access-Control-Allow-Headers"] == "authorization"
    resp = await client.post("/v1/x", headers={"Origin": "https://b.example"})
    assert resp.headers["Access-Control-Allow-Origin"] == "*"


def test_the_template_lists_tools_and_renders_calls_and_results(tiny_model) -> None:
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    req = parse_chat_request(
        {
            "model": "m",
            "tools": tools,
            "messages": [
                {"role": "user", "content": "time?"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
                    ],
                },
                {"role": "tool", "tool_call_id": "1", "content": "noon"},
            ],
        }
    )
    builder = PromptBuilder(ModelSpec.load(tiny_model))
    text = builder.render(req.messages, req.tools.functions)
    assert '<tools>\n{"type": "function", "function": {"name": "get_time"' in text
    assert '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>' in text
    assert "<tool_response>\nnoon\n</tool_response>" in text
    assert builder.render(req.messages[:1]) == builder.render(req.messages[:1], None)  # no tools: as before
    builder.chat_template = builder.chat_template.replace("tools", "tool_list")
    with pytest.raises(APIError) as info:
        builder.render(req.messages, req.tools.functions)
    assert info.value.param == "tools"
