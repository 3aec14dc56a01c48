"""Output logprobs of ``mmcache serve`` equal Hugging Face's, and the ``openai`` client reads them.

Greedy answers with ``logprobs`` and ``top_logprobs``: each token's logprob and its top entries
equal a log-softmax over HF ``generate``'s scores (within 1e-5) for both Qwen2 architectures, in
the non-streaming and the streaming shape, cold and warm (prefix cache hit).
"""

from __future__ import annotations

import math

import pytest
from transformers import AutoTokenizer

from tests import media
from tests.e2e.server import serving
from tests.e2e.test_exactness import reference_inputs
from tests.e2e.util import stream_events
from tests.hf_reference import hf_greedy_logprobs, load

pytestmark = pytest.mark.e2e

ARCHS = ("qwen2-vl", "qwen2.5-vl")
MAX_TOKENS = 8
TOP = 5
TOL = 1e-5
IMAGE = media.image_bytes(448, 448, seed=0)


@pytest.fixture(scope="module", params=ARCHS)
def server(request, tiny_models):
    with serving(tiny_models[request.param]) as srv:
        yield srv


def _messages() -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": media.data_url(IMAGE, "image/png")}},
                {"type": "text", "text": "Describe the picture."},
            ],
        }
    ]


@pytest.fixture(scope="module")
def reference(server):
    return hf_greedy_logprobs(server.model, *reference_inputs(_messages()), max_new_tokens=MAX_TOKENS)


def _check(entries, ref_ids: list[int], ref: object, tokenizer) -> None:
    """``entries``: the ``openai`` client's ``logprobs.content`` items."""
    assert len(entries) == len(ref_ids)
    for step, (entry, token) in enumerate(zip(entries, ref_ids, strict=True)):
        assert entry.token == tokenizer.decode([token])
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert math.isclose(entry.logprob, float(ref[step, token]), abs_tol=TOL)
        assert len(entry.top_logprobs) == TOP
        want = ref[step].topk(TOP).values.tolist()
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(want, abs=TOL)
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=TOL)


def _ask(client, server, **extra):
    """The greedy answer to :func:`_messages` with its logprobs and top entries."""
    return client.chat.completions.create(
        model=server.model.name,
        messages=_messages(),
        temperature=0,
        max_tokens=MAX_TOKENS,
        logprobs=True,
        top_logprobs=TOP,
        **extra,
    )


def test_greedy_logprobs_equal_transformers(client, server, reference) -> None:
    ref_ids, ref = reference
    tokenizer = load(str(server.model))[0].tokenizer
    cached = []
    for _ in range(2):  # cold, then served from the prefix cache
        out = _ask(client, server, extra_body={"return_token_ids": True})
        (choice,) = out.choices
        assert choice.model_extra["token_ids"] == ref_ids
        _check(choice.logprobs.content, ref_ids, ref, tokenizer)
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
    assert cached[1] > 0


def test_streamed_logprobs_equal_transformers(client, server, reference) -> None:
    ref_ids, ref = reference
    tokenizer = load(str(server.model))[0].tokenizer
    stream = _ask(client, server, stream=True)
    entries = []
    for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                entries += choice.logprobs.content
    _check(entries, ref_ids, ref, tokenizer)


def test_sampled_logprobs_follow_the_truncated_distribution(server) -> None:
    """With top_k the drawn token's distribution holds k tokens: their probabilities sum to 1 and
    every other token reports the floor."""
    status, body = server.post(
        "/v1/chat/completions",
        {
            "model": server.model.name,
            "messages": _messages(),
            "temperature": 0.8,
            "top_k": 3,
            "seed": 1,
            "max_tokens": 4,
            "logprobs": True,
            "top_logprobs": 4,
        },
    )
    assert status == 200, body
    for entry in body["choices"][0]["logprobs"]["content"]:
        tops = [t["logprob"] for t in entry["top_logprobs"]]
        assert math.fsum(math.exp(v) for v in tops[:3]) == pytest.approx(1.0, abs=1e-5)
        assert tops[3] == -9999.0
        assert min(abs(entry["logprob"] - v) for v in tops[:3]) < 1e-6  # the drawn token is one of them


def test_no_logprobs_unless_asked(server) -> None:
    status, body = server.post(
        "/v1/chat/completions",
        {"model": server.model.name, "messages": _messages(), "temperature": 0, "max_tokens": 2},
    )
    assert status == 200, body
    assert body["choices"][0]["logprobs"] is None
    assert "prompt_logprobs" not in body


def test_a_stop_string_ends_the_logprobs_with_the_text(server) -> None:
    """The logprobs cover the answer's tokens: through the one that completes the stop string (as
    vLLM does), not the ones the stage generated after it; streamed and not alike."""
    tokenizer = AutoTokenizer.from_pretrained(server.model)
    body = {
        "model": server.model.name,
        "messages": _messages(),
        "temperature": 0,
        "max_tokens": 24,
        "ignore_eos": True,
        "logprobs": True,
        "return_token_ids": True,
    }
    status, plain = server.post("/v1/chat/completions", body)
    assert status == 200, plain
    ids = plain["choices"][0]["token_ids"]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    # A stop string that starts inside the 4th token's text and ends in a later one.
    at = len(tokenizer.decode(ids[:3], skip_special_tokens=True)) + 1
    stop = text[at : at + 6]
    kept = next(
        k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k], skip_special_tokens=True)
    )
    assert kept < len(ids) - 4  # the stage would go on without the stop string
    status, cut = server.post("/v1/chat/completions", {**body, "stop": [stop]})
    assert status == 200, cut
    choice = cut["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == text[: text.index(stop)]
    assert choice["token_ids"] == ids[:kept]
    assert cut["usage"]["completion_tokens"] == kept
    entries = choice["logprobs"]["content"]
    before = plain["choices"][0]["logprobs"]["content"][:kept]
    assert [e["token"] for e in entries] == [e["token"] for e in before]
    # NOTE: within TOL, not equal: the second request's prompt is a prefix-cache hit.
    assert [e["logprob"] for e in entries] == pytest.approx([e["logprob"] for e in before], abs=TOL)
    chunks = stream_events(server, {**body, "stop": [stop]})
    streamed = [e for c in chunks for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
    assert streamed == entries
    assert (
        "".join(ch["delta"].get("content", "") for c in chunks for ch in c["choices"])
        == text[: text.index(stop)]
    )
