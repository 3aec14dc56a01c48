"""Responses requests as chat requests: input items, instructions, stored turns, tools,
text.format; what is not supported is a 400 naming the field."""

from __future__ import annotations

import pytest

from mmcache.processor.errors import APIError
from mmcache.processor.response_store import ResponseStore
from mmcache.processor.responses_api import parse_responses

FN = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}


def parse(kept: ResponseStore | None = None, **body):
    return parse_responses({"model": "m", **body}, {}, kept or ResponseStore(8, 1 << 20, 60))


def test_input_items_become_chat_turns() -> None:
    req = parse(
        instructions="be brief",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "hi"},
                    {"type": "input_image", "image_url": "http://x/a.png"},
                ],
            },
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "f", "arguments": '{"a": 1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
            {"role": "user", "content": "more", "type": "message"},
        ],
        tools=[FN],
    )
    roles = [m["role"] for m in req.chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert [c["function"]["arguments"] for c in req.chat.messages[2]["tool_calls"]] == [{}, {"a": 1}]
    assert req.chat.media[0].url == "http://x/a.png"
    # What is stored: the turns in chat's API form (the image's URL kept), not the instructions.
    assert [m["role"] for m in req.history] == roles[1:]
    assert req.history[0]["content"][1] == {"type": "image_url", "image_url": {"url": "http://x/a.png"}}


def test_previous_turns_come_first_and_only_with_their_salt() -> None:
    store = ResponseStore(8, 1 << 20, 60)
    store.put("resp_1", "s", [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    req = parse(store, previous_response_id="resp_1", input="c", cache_salt="s")
    assert [m["content"] for m in req.chat.messages] == ["a", "b", "c"]
    with pytest.raises(APIError) as err:
        parse(store, previous_response_id="resp_1", input="c")
    assert (err.value.status, err.value.param) == (404, "previous_response_id")


def test_tools_choice_and_format_translate() -> None:
    req = parse(input="x", tools=[FN], tool_choice={"type": "function", "name": "f"})
    assert req.chat.tools is not None and req.chat.tools.forced == "f" and req.chat.grammar
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    req = parse(input="x", text={"format": {"type": "json_schema", "name": "n", "schema": schema}})
    assert req.chat.grammar
    req = parse(input="x", max_output_tokens=5, temperature=0.5, top_p=0.9)
    assert (req.chat.max_tokens, req.chat.temperature, req.chat.top_p) == (5, 0.5, 0.9)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "reasoning": {"effort": "low"}}, "reasoning"),
        ({"input": "x", "include": ["file_search_call.results"]}, "include"),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        ({"input": "x", "prompt": {"id": "p"}}, "prompt"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"input": [{"type": "reasoning"}]}, "input[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input[0].content[0]"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
        ({"input": []}, "input"),
    ],
)
def test_unsupported_is_a_400_naming_the_field(body, param) -> None:
    with pytest.raises(APIError) as err:
        parse(**body)
    assert (err.value.status, err.value.param) == (400, param)


def test_an_image_by_file_id_is_a_media_uuid_and_store_false_is_kept() -> None:
    part = {"type": "input_image", "file_id": "img-1"}
    req = parse(input=[{"role": "user", "content": [part]}], store=False)
    assert (req.chat.media[0].uuid, req.chat.media[0].url) == ("img-1", None)
    assert req.store is False
