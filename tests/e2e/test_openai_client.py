"""The official ``openai`` client talks to ``mmcache serve`` (the default tiny model)."""

from __future__ import annotations

import openai
import pytest

from tests import media
from tests.hf_reference import load

pytestmark = pytest.mark.e2e

IMAGE = media.image_bytes(448, 448, seed=7)  # 32x32 patches, merged 2x2: 256 image tokens
IMAGE_TOKENS = 256
MAX_TOKENS = 24


def _messages() -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": media.data_url(IMAGE, "image/png")}},
                {"type": "text", "text": "What is in this image?"},
            ],
        }
    ]


@pytest.fixture(scope="module")
def completion(client, server):
    """One greedy non-streaming answer (with the token ids, an mmcache extension)."""
    return client.chat.completions.create(
        model=server.model.name,
        messages=_messages(),
        temperature=0,
        max_tokens=MAX_TOKENS,
        extra_body={"return_token_ids": True},
    )


def test_models_list(client, server) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model.name]
    assert client.models.list().data[0].object == "model"


def test_completion(completion, server) -> None:
    assert completion.object == "chat.completion"
    assert completion.model == server.model.name
    assert completion.id
    (choice,) = completion.choices
    assert choice.message.role == "assistant"
    assert choice.message.content
    token_ids = choice.model_extra["token_ids"]
    assert 1 <= len(token_ids) <= MAX_TOKENS
    assert choice.finish_reason == ("length" if len(token_ids) == MAX_TOKENS else "stop")
    tokenizer = load(str(server.model))[0].tokenizer
    assert choice.message.content == tokenizer.decode(token_ids, skip_special_tokens=True)

    usage = completion.usage
    assert usage.completion_tokens == len(token_ids)
    prompt_ids = completion.model_extra["prompt_token_ids"]
    assert usage.prompt_tokens == len(prompt_ids) > IMAGE_TOKENS
    image_pad = load(str(server.model))[1].config.image_token_id
    assert prompt_ids.count(image_pad) == IMAGE_TOKENS
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 0 <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens


def test_stream_matches_completion(client, server, completion) -> None:
    stream = client.chat.completions.create(
        model=server.model.name,
        messages=_messages(),
        temperature=0,
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    content_chunks = [c for c in chunks if c.choices]
    assert len({c.id for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" and c.model == server.model.name for c in chunks)
    assert content_chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert text == completion.choices[0].message.content
    assert len([c for c in content_chunks if c.choices[0].delta.content]) >= 2  # really streamed
    finishes = [c.choices[0].finish_reason for c in content_chunks]
    assert finishes[-1] == completion.choices[0].finish_reason
    assert all(f is None for f in finishes[:-1])

    usage = chunks[-1].usage  # include_usage: a last chunk with no choices carries the usage
    assert chunks[-1].choices == []
    assert usage.completion_tokens == completion.usage.completion_tokens
    assert usage.prompt_tokens == completion.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: prefix cache hit


def test_stream_without_usage(client, server) -> None:
    chunks = list(
        client.chat.completions.create(
            model=server.model.name,
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=4,
            temperature=0,
            stream=True,
        )
    )
    assert chunks and all(c.usage is None and c.choices for c in chunks)


def test_client_error_is_raised_as_openai_error(client, server) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.model.name, messages=[], max_tokens=4)
    assert info.value.status_code == 400
    assert "messages" in info.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )


@pytest.mark.parametrize("stream", [False, True], ids=["completion", "stream"])
def test_stop_string_cuts_the_answer_and_stops_generation(client, stream):
    kwargs = {"model": client.models.list().data[0].id, "messages": _messages(), "temperature": 0}
    full = client.chat.completions.create(**kwargs, max_tokens=MAX_TOKENS)
    text = full.choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3 and stop.strip()
    expected = text[: text.index(stop)]
    if stream:
        chunks = list(
            client.chat.completions.create(**kwargs, max_tokens=MAX_TOKENS, stop=[stop], stream=True)
        )
        got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        out = client.chat.completions.create(**kwargs, max_tokens=MAX_TOKENS, stop=[stop])
        got, finish = out.choices[0].message.content, [out.choices[0].finish_reason]
        assert out.usage.completion_tokens < full.usage.completion_tokens  # generation stopped early
    assert got == expected
    assert finish == ["stop"]
