"""Tool-call blocks out of model text, whole and streamed in arbitrary pieces: a call's first delta
carries its id, type, name and empty arguments as soon as the name is read, then its arguments
stream as their text arrives; the pieces assemble into exactly the whole-text answer."""

from __future__ import annotations

import json
import random

import pytest

from mmcache.processor.tool_stream import ToolStream, split_tool_calls

TEXT = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
TRICKY = [  # arguments with braces and quotes in strings, nesting, other keys, odd spacing
    '<tool_call>{"name": "f", "arguments": {"q": "a}\\"{ ]", "n": [1, {"x": [2]}]}, "extra": {"y": 1}}'
    "</tool_call>",
    '<tool_call>\n{ "name" :"g\\u00e9", "parameters":[1 , 2] }\n</tool_call> tail',
    '<tool_call>{"name": "h", "arguments": 12.5}</tool_call>',
    '<tool_call>{"name": "k", "arguments": "{\\"a\\": 1}"}</tool_call>',
    '<tool_call>{"name": "m"}</tool_call>',
    'x <tool_call>{"arguments": {"a": 1}, "name": "late"}</tool_call> y',
    "<tool_call>\nnot json\n</tool_call>",
    '<tool_call>{"name": "cut", "arguments": {"a": [1, 2',
    TEXT,
]


def stream(text: str, sizes: list[int]) -> tuple[str, dict[int, dict], list[list[dict]]]:
    """Feed ``text`` in pieces of the given sizes (cycled): the content, each call as its deltas
    assemble it (by index), and every chunk's ``tool_calls`` entries."""
    tools, content, calls, chunks = ToolStream(), "", {}, []
    at, i = 0, 0
    while at < len(text):
        piece = text[at : at + sizes[i % len(sizes)]]
        at, i = at + len(piece), i + 1
        got, deltas = tools.feed(piece, final=at >= len(text))
        content += got
        entries = [d.as_dict() for d in deltas]
        chunks.append(entries)
        for entry in entries:
            call = calls.setdefault(entry["index"], {"id": None, "name": "", "arguments": ""})
            if "id" in entry:
                assert call["id"] is None and entry["type"] == "function"
                call["id"], call["name"] = entry["id"], entry["function"]["name"]
            call["arguments"] += entry["function"]["arguments"]
    return content, calls, chunks


def test_split_finds_every_call_and_keeps_the_text() -> None:
    content, calls = split_tool_calls(TEXT)
    assert content == "Let me check."
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_time", "{}"),
    ]
    assert len({c.id for c in calls}) == 2


def test_a_block_that_is_not_a_call_stays_text() -> None:
    text = "<tool_call>\nnot json\n</tool_call> and <tool_call>{broken"
    assert split_tool_calls(text) == (text, [])


def test_arguments_are_the_models_text_of_the_arguments_value() -> None:
    calls = [split_tool_calls(text)[1] for text in TRICKY[:5]]
    assert [[(c.name, c.arguments) for c in cs] for cs in calls] == [
        [("f", '{"q": "a}\\"{ ]", "n": [1, {"x": [2]}]}')],
        [("gé", "[1 , 2]")],
        [("h", "12.5")],
        [("k", '"{\\"a\\": 1}"')],
        [("m", "{}")],  # no arguments: none
    ]


def test_a_call_whose_name_comes_later_is_one_whole_delta() -> None:
    content, calls, chunks = stream(TRICKY[5], [1])
    assert content == "x  y"
    assert calls == {0: {"id": calls[0]["id"], "name": "late", "arguments": '{"a": 1}'}}
    assert sum(len(c) for c in chunks) == 1  # held until its block closed


def test_a_call_cut_off_keeps_what_was_written() -> None:
    content, calls = split_tool_calls(TRICKY[7])
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("cut", '{"a": [1, 2')]


def test_the_first_delta_comes_with_the_name_then_the_arguments_stream() -> None:
    tools = ToolStream()
    assert tools.feed("Sure.\n<tool_call>\n") == ("Sure.", [])
    assert tools.feed('{"name": "get_wea') == ("", [])
    content, deltas = tools.feed('ther", "argu')
    assert content == ""
    [first] = [d.as_dict() for d in deltas]
    assert first == {
        "index": 0,
        "id": first["id"],
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    assert first["id"].startswith("call_")
    assert [d.as_dict() for d in tools.feed('ments": {"city": "Pa')[1]] == [
        {"index": 0, "function": {"arguments": '{"city": "Pa'}}
    ]
    assert [d.as_dict() for d in tools.feed('ris"}}\n</tool_call>')[1]] == [
        {"index": 0, "function": {"arguments": 'ris"}'}}
    ]
    assert tools.calls[0].arguments == '{"city": "Paris"}'


@pytest.mark.parametrize("text", TRICKY, ids=range(len(TRICKY)))
def test_any_pieces_give_the_whole_texts_answer(text: str) -> None:
    content, calls = split_tool_calls(text)
    want = {i: {"name": c.name, "arguments": c.arguments} for i, c in enumerate(calls)}
    rng = random.Random(len(text))
    for sizes in ([1], [2], [3], [5, 1, 8], [len(text)], [rng.randint(1, 9) for _ in range(50)]):
        got_content, got, chunks = stream(text, sizes)
        assert {i: {"name": c["name"], "arguments": c["arguments"]} for i, c in got.items()} == want
        assert got_content.strip() == content.strip()
        for entries in chunks:  # a call starts with empty arguments; its fragments come after
            assert all(e["function"]["arguments"] == "" for e in entries if "id" in e and "late" not in text)
        if calls:
            assert "tool_call" not in got_content  # no part of a block leaves as content


def test_streamed_calls_that_are_json_parse() -> None:
    _, calls, _ = stream(TEXT, [1])
    assert [json.loads(c["arguments"]) for c in calls.values()] == [{"city": "Paris"}, {}]


def test_an_unclosed_block_is_text_at_the_end() -> None:
    stream_ = ToolStream()
    assert stream_.feed("hi <tool") == ("hi ", [])
    assert stream_.feed('_call>{"name"', final=True) == ('<tool_call>{"name"', [])
