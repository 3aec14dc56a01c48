"""Choices and completions from LLM-stage replies (the tiny checkpoint's real tokenizer): when a
stop string cuts the text, the answer's tokens (usage, token_ids, logprobs) end at the token that
completes the stop string (vLLM's rule), however the stage grouped the tokens into replies."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from mmcache.processor.pipeline import Prepared
from mmcache.processor.request import parse_chat_request
from mmcache.processor.responses import Completion
from mmcache.shared.messages import GenerateReply, TokenLogprobs

TEXT = "the baker pulled golden loaves from a brick oven while gulls argued over scraps"
STOP = "loaves from"


@pytest.fixture(scope="module")
def tok(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def completion(tok, **extra) -> Completion:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    req = parse_chat_request(body)
    return Completion("m", req, Prepared(req, [1, 2, 3], [], [], None), tok)


def replies(ids: list[int], size: int) -> list[GenerateReply]:
    """The stage's replies, ``size`` tokens each; token i's logprob is -i (to tell them apart)."""
    out = []
    for at in range(0, len(ids), size):
        part = ids[at : at + size]
        lps = [TokenLogprobs(-float(at + i), [ids[at + i]], [-float(at + i)]) for i in range(len(part))]
        out.append(GenerateReply(part, "length" if at + size >= len(ids) else None, 3, 0, lps))
    return out


def completing_token(tok, ids: list[int], stop: str) -> int:
    """How many tokens it takes for the decoded text to hold ``stop``."""
    return next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))


@pytest.mark.parametrize("size", [1, 3, 5, 100])
def test_a_stop_string_ends_tokens_and_logprobs_at_the_token_that_completes_it(tok, size) -> None:
    ids = tok.encode(TEXT, add_special_tokens=False)
    kept = completing_token(tok, ids, STOP)
    assert 1 < kept < len(ids) - 3  # tokens follow the stop string, some in the same reply
    done = completion(tok, stop=[STOP], logprobs=True, top_logprobs=1, return_token_ids=True)
    for reply in replies(ids, size):
        done.choices[0].update(reply)
    body = done.body()
    choice = body["choices"][0]
    assert choice["message"]["content"] == TEXT[: TEXT.index(STOP)]
    assert choice["finish_reason"] == "stop"
    assert choice["token_ids"] == ids[:kept]
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == [-float(i) for i in range(kept)]
    assert [e["token"] for e in choice["logprobs"]["content"]] == [tok.decode([t]) for t in ids[:kept]]
    assert body["usage"]["completion_tokens"] == kept


@pytest.mark.parametrize("size", [1, 4])
def test_streamed_logprobs_are_the_same_entries(tok, size) -> None:
    ids = tok.encode(TEXT, add_special_tokens=False)
    whole = completion(tok, stop=[STOP], logprobs=True)
    streamed = completion(tok, stop=[STOP], logprobs=True, stream=True)
    entries, text = [], ""
    for reply in replies(ids, size):
        whole.choices[0].update(reply)
        choice = streamed.choices[0]
        if choice.finish_reason is not None:
            break  # as the server does: the stage's later replies are not read
        choice.update(reply)
        for delta in choice.deltas():
            chunk = streamed.chunk(choice, delta)
            entries += chunk["choices"][0]["logprobs"]["content"]
            text += chunk["choices"][0]["delta"].get("content", "")
    body = whole.body()
    assert text == body["choices"][0]["message"]["content"]
    assert entries == body["choices"][0]["logprobs"]["content"]
    assert len(entries) == completing_token(tok, ids, STOP)


def test_without_stop_strings_every_token_counts(tok) -> None:
    ids = tok.encode(TEXT, add_special_tokens=False)
    done = completion(tok, logprobs=True)
    for reply in replies(ids, 4):
        done.choices[0].update(reply)
    body = done.body()
    assert body["choices"][0]["message"]["content"] == TEXT
    assert len(body["choices"][0]["logprobs"]["content"]) == len(ids) == body["usage"]["completion_tokens"]


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CALLS = (
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
)


@pytest.mark.parametrize("size", [1, 3, 100])
def test_tool_calls_stream_name_first_then_argument_fragments(tok, size) -> None:
    ids = tok.encode(CALLS, add_special_tokens=False)
    whole = completion(tok, tools=[TOOL])
    streamed = completion(tok, tools=[TOOL], stream=True)
    deltas = []
    for reply in replies(ids, size):
        whole.choices[0].update(reply)
        streamed.choices[0].update(reply)
        deltas += streamed.choices[0].deltas()
    message = whole.body()["choices"][0]["message"]
    assert message["content"] == "Checking."
    assert [json.loads(c["function"]["arguments"])["city"] for c in message["tool_calls"]] == [
        "Paris",
        "Oslo",
    ]
    entries = [e for d in deltas for e in d.get("tool_calls", [])]
    assert all(
        len({e["index"] for e in d.get("tool_calls", [])}) == len(d.get("tool_calls", [])) for d in deltas
    )
    starts = [e for e in entries if "id" in e]
    assert [(e["index"], e["function"]["name"], e["function"]["arguments"]) for e in starts] == [
        (0, "get_weather", ""),
        (1, "get_weather", ""),
    ]
    for i, call in enumerate(message["tool_calls"]):
        fragments = [e["function"]["arguments"] for e in entries if e["index"] == i and "id" not in e]
        assert "".join(fragments) == call["function"]["arguments"]
        if size == 1:
            assert len(fragments) > 3  # the arguments came as the model wrote them
    assert "".join(d.get("content", "") for d in deltas) == "Checking."
