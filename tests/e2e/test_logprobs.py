"""Output logprobs of ``mmcache serve`` equal Hugging Face's, and the ``openai`` client reads them.

Greedy answers with ``logprobs`` and ``top_logprobs``: each token's logprob and its top entries
equal a log-softmax over HF ``generate``'s scores (within 1e-5) for both Qwen2 architectures, in
the non-streaming and the streaming shape, cold and warm (prefix cache hit).
"""

from __future__ import annotations

import math

import pytest

from tests import media
from tests.e2e.server import serving
from tests.e2e.test_exactness import reference_inputs
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
