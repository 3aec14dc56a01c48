"""``POST /v1/completions`` (the official client) and ``/tokenize`` / ``/detokenize``.

Scoring a prompt (``echo=True, logprobs=5, max_tokens=0``) gives the values chat's
``prompt_logprobs`` gives and a log-softmax over Hugging Face's logits, the same whether the
prompt was cached (a prefix hit: from the prompt-logprob store) or not (``--no-cache``)."""

from __future__ import annotations

import math

import pytest

from tests import media
from tests.e2e.util import ok
from tests.hf_reference import hf_prompt_logprobs
from tests.openai_schema import validate

pytestmark = pytest.mark.e2e

K = 5
TOL = 1e-5
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Tell me a story about the sea, the stars and a lighthouse keeper."},
]


def dump(obj) -> dict:
    return obj.model_dump(mode="json", exclude_unset=True, by_alias=True)


def chat_scores(server) -> tuple[list[int], list]:
    out = ok(
        server,
        {
            "model": server.model.name,
            "messages": MESSAGES,
            "max_tokens": 1,
            "prompt_logprobs": K,
            "return_token_ids": True,
        },
    )
    return out["prompt_token_ids"], out["prompt_logprobs"]


def score(client, server, prompt) -> dict:
    out = client.completions.create(
        model=server.model.name, prompt=prompt, echo=True, logprobs=K, max_tokens=0
    )
    raw = dump(out)
    validate(_first_token_dropped(raw), "CreateCompletionResponse")
    return raw


def _first_token_dropped(out: dict) -> dict:
    """``out`` without each echoed prompt's first token: its logprob is null (nothing precedes it),
    as OpenAI's and vLLM's answers have it, though the published schema has no null there."""
    choices = []
    for choice in out["choices"]:
        lp = choice["logprobs"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        choices.append({**choice, "logprobs": {k: v[1:] for k, v in lp.items()}})
    return {**out, "choices": choices}


def test_scoring_a_prompt_equals_chat_and_transformers_cached_or_not(client, server, baseline) -> None:
    ids, chat = chat_scores(server)
    text = None
    warm = score(client, server, ids)  # chat just cached this prompt: a prefix hit
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert warm["usage"]["completion_tokens"] == 0
    from openai import OpenAI

    with OpenAI(base_url=baseline.url + "/v1", api_key="x", max_retries=0) as uncached_client:
        uncached = score(uncached_client, baseline, ids)
    assert uncached["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _, ref = hf_prompt_logprobs(server.model, MESSAGES)
    for out in (warm, uncached):
        (choice,) = out["choices"]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for j in range(1, len(ids)):
            own = lp["token_logprobs"][j]
            assert math.isclose(own, chat[j][str(ids[j])]["logprob"], abs_tol=TOL)
            assert math.isclose(own, float(ref[j - 1, ids[j]]), abs_tol=TOL)
            top = sorted(lp["top_logprobs"][j].values(), reverse=True)[:K]
            assert top == pytest.approx(ref[j - 1].topk(K).values.tolist()[: len(top)], abs=TOL)
        text = choice["text"]
        assert lp["text_offset"][-1] + len(lp["tokens"][-1]) == len("".join(lp["tokens"]))
    server_text = server.post("/detokenize", {"tokens": ids})[1]["prompt"]
    assert text == server_text
    # The same prompt as text tokenises to the same ids and scores the same.
    again = score(client, server, server_text)
    assert again["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        warm["choices"][0]["logprobs"]["token_logprobs"], abs=TOL
    )


def test_generation_streamed_and_not_n_and_stop(client, server) -> None:
    args = {"model": server.model.name, "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0}
    whole = client.completions.create(**args, logprobs=2)
    validate(dump(whole), "CreateCompletionResponse")
    (choice,) = whole.choices
    assert len(choice.logprobs.tokens) == whole.usage.completion_tokens
    assert "".join(choice.logprobs.tokens) == choice.text
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    two = client.completions.create(**{**args, "temperature": 1.0, "seed": 3}, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    stop = choice.text[3:6]
    cut = client.completions.create(**args, stop=[stop])
    assert cut.choices[0].text == choice.text[: choice.text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    many = client.completions.create(**{**args, "prompt": ["Once upon a time", "The sea"]})
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == choice.text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"suffix": "end"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"logprobs": 6}, "logprobs"),
        ({"max_tokens": -1}, "max_tokens"),
    ],
)
def test_what_is_refused_is_a_400_naming_the_field(server, extra, param) -> None:
    status, out = server.post("/v1/completions", {"model": server.model.name, "prompt": "hi", **extra})
    assert status == 400, out
    validate(out, "ErrorResponse")
    assert out["error"]["param"] == param


def test_tokenize_counts_media_tokens_and_detokenize_inverts(server) -> None:
    image = media.data_url(media.image_bytes(448, 448, seed=21), "image/png")
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image}},
                {"type": "text", "text": "What?"},
            ],
        }
    ]
    status, tok = server.post("/tokenize", {"model": server.model.name, "messages": messages})
    assert status == 200, tok
    body = {"model": server.model.name, "messages": messages, "max_tokens": 1, "return_token_ids": True}
    chat = ok(server, body)
    assert tok["tokens"] == chat["prompt_token_ids"]
    assert tok["count"] == chat["usage"]["prompt_tokens"] > 256  # 448x448: 256 image tokens
    assert tok["max_model_len"] > tok["count"]
    status, text = server.post("/tokenize", {"prompt": "hello world", "return_token_strs": True})
    assert status == 200 and len(text["token_strs"]) == text["count"]
    status, back = server.post("/detokenize", {"tokens": text["tokens"]})
    assert status == 200 and back["prompt"] == "hello world"
    assert server.post("/detokenize", {"tokens": [-1]})[0] == 400
    assert server.post("/tokenize", {"prompt": 3})[0] == 400
