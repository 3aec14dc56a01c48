"""Tool-call blocks out of model text, whole and streamed in arbitrary pieces; CORS preflights."""

from __future__ import annotations

import json

import pytest
from aiohttp import web

from processor.cors import setup_cors
from processor.errors import APIError, error_middleware
from processor.prompt import PromptBuilder
from processor.request import parse_chat_request
from processor.tools import ToolStream, split_tool_calls
from shared.checkpoint import ModelSpec

TEXT = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def test_split_finds_every_call_and_keeps_the_text() -> None:
    content, calls = split_tool_calls(TEXT)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert len({c.id for c in calls}) == 2


def test_a_block_that_is_not_a_call_stays_text() -> None:
    text = "<tool_call>\nnot json\n</tool_call> and <tool_call>{broken"
    assert split_tool_calls(text) == (text, [])


@pytest.mark.parametrize("size", [1, 3, 7, len(TEXT)])
def test_streamed_pieces_give_the_same_calls_and_no_block_text(size: int) -> None:
    stream = ToolStream()
    content, calls = "", []
    pieces = [TEXT[i : i + size] for i in range(0, len(TEXT), size)]
    for i, piece in enumerate(pieces):
        text, new = stream.feed(piece, final=i == len(pieces) - 1)
        content += text
        calls += new
        assert "tool_call" not in text  # no part of a block leaves as content
    assert content.strip() == "Let me check."
    assert [c.name for c in calls] == ["get_weather", "get_time"]


def test_an_unclosed_block_is_text_at_the_end() -> None:
    stream = ToolStream()
    assert stream.feed("hi <tool") == ("hi ", [])
    assert stream.feed('_call>{"name"', final=True) == ('<tool_call>{"name"', [])


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
