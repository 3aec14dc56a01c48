"""What agent frameworks lean on, through the official ``openai`` client against ``mmcache serve``:
structured outputs, tool calls, ``n``, logit_bias, conformance with OpenAI's published schemas."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field
from transformers import AutoTokenizer

from tests.e2e.server import Server, serving
from tests.e2e.util import metrics, stream_events
from tests.openai_schema import validate, validate_stream

pytestmark = pytest.mark.e2e

ORIGIN = "https://app.example"
MAX_STOP_TOKENS = 160  # max_tokens when a stop string should end a choice early
ABORT_SLACK_TOKENS = 40  # steps a choice may still run after its stop string, until its abort lands
QUESTION = [{"role": "user", "content": "Name a harbor town and rate it."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "town": {"type": "string", "minLength": 1, "maxLength": 16},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "kind": {"enum": ["port", "village", "city"]},
        "streets": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 10},
                    "shops": {"type": "integer", "minimum": 0, "maximum": 999},
                },
                "required": ["name", "shops"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 2,
        },
    },
    "required": ["town", "rating", "kind", "streets"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 8}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def server(tiny_model):
    with serving(tiny_model, "--allowed-origins", ORIGIN) as srv:
        yield srv


def raw(server: Server, body: dict) -> dict:
    status, out = server.post("/v1/chat/completions", {"model": server.model.name, **body})
    assert status == 200, out
    return out


def metric(server: Server, name: str) -> float:
    """An LLM-stage counter, summed over its replicas (each serves its own /metrics)."""
    return metrics(server)[f"mmcache_llm_{name}_total"]


# --- conformance ------------------------------------------------------------------------------


def test_response_and_every_stream_chunk_validate_against_openai_schema(server) -> None:
    body = {"messages": QUESTION, "max_tokens": 8, "temperature": 0}
    out = raw(server, body)
    validate(out, "CreateChatCompletionResponse")
    assert out["choices"][0]["message"]["refusal"] is None
    chunks = stream_events(server, {**body, "stream_options": {"include_usage": True}})
    validate_stream(chunks, include_usage=True)  # usage: null on every chunk before the last
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    validate_stream(stream_events(server, body), include_usage=False)


def test_logprobs_validate_against_openai_schema(server) -> None:
    body = {"messages": QUESTION, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    out = raw(server, body)
    validate(out, "CreateChatCompletionResponse")
    assert len(out["choices"][0]["logprobs"]["content"]) == 4
    chunks = stream_events(server, body)
    for chunk in chunks:
        validate(chunk, "CreateChatCompletionStreamResponse")
    streamed = [e for c in chunks for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
    assert streamed == out["choices"][0]["logprobs"]["content"]


def test_developer_role_is_the_system_turn(server) -> None:
    dev = raw(
        server, {"messages": [{"role": "developer", "content": "Be brief."}, *QUESTION], "max_tokens": 4}
    )
    sys = raw(server, {"messages": [{"role": "system", "content": "Be brief."}, *QUESTION], "max_tokens": 4})
    assert dev["usage"]["prompt_tokens"] == sys["usage"]["prompt_tokens"]


def test_models_retrieve_and_errors_validate(client, server) -> None:
    assert client.models.retrieve(server.model.name).id == server.model.name
    status, card = server.get(f"/v1/models/{server.model.name}")
    validate(card, "Model")
    validate(server.get("/v1/models")[1], "ListModelsResponse")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    for status, err in (
        server.get("/v1/models/nope"),
        server.get("/v1/chat/completions"),  # 405
        server.post("/v1/chat/completions", {"model": server.model.name, "messages": []}),
        server.post("/v1/chat/completions", {"model": server.model.name, "messages": QUESTION, "audio": {}}),
    ):
        validate(err, "ErrorResponse")
        assert err["error"]["type"] == "invalid_request_error", (status, err)
    assert server.get("/v1/chat/completions")[0] == 405


def test_cors_answers_the_allowed_origin_only(server) -> None:
    def preflight(origin: str) -> tuple[int, dict]:
        req = urllib.request.Request(
            server.url + "/v1/chat/completions",
            method="OPTIONS",
            headers={"Origin": origin, "Access-Control-Request-Method": "POST"},
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, dict(resp.headers)
        except urllib.error.HTTPError as err:
            return err.code, dict(err.headers)

    status, headers = preflight(ORIGIN)
    assert status == 204 and headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in headers["Access-Control-Allow-Methods"]
    status, headers = preflight("https://evil.example")
    assert status == 403 and "Access-Control-Allow-Origin" not in headers
    req = urllib.request.Request(server.url + "/v1/models", headers={"Origin": ORIGIN})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.headers["Access-Control-Allow-Origin"] == ORIGIN


# --- sampling controls --------------------------------------------------------------------------


def test_n_two_gives_two_choices_from_one_prefill(server) -> None:
    long_question = [{"role": "user", "content": "Describe the harbor, the bakery and the mill. " * 6}]
    queries, hits = metric(server, "prefix_cache_queries"), metric(server, "prefix_cache_hits")
    out = raw(server, {"messages": long_question, "max_tokens": 6, "n": 2, "temperature": 1.0, "seed": 3})
    validate(out, "CreateChatCompletionResponse")
    assert [c["index"] for c in out["choices"]] == [0, 1]
    first = out["usage"]["prompt_tokens"] - out["usage"]["prompt_tokens_details"]["cached_tokens"]
    computed = (metric(server, "prefix_cache_queries") - queries) - (
        metric(server, "prefix_cache_hits") - hits
    )
    assert metric(server, "prefix_cache_queries") - queries == 2 * out["usage"]["prompt_tokens"]
    # One prefill: the second choice recomputes at most the prompt's last, partial block (16 tokens).
    assert first < computed <= first + 16
    assert out["usage"]["completion_tokens"] == 12
    assert out["choices"][0]["message"]["content"] != out["choices"][1]["message"]["content"]  # seed + i
    again = raw(server, {"messages": long_question, "max_tokens": 6, "n": 2, "temperature": 1.0, "seed": 3})
    assert [c["message"] for c in again["choices"]] == [c["message"] for c in out["choices"]]
    chunks = stream_events(
        server,
        {
            "messages": long_question,
            "max_tokens": 6,
            "n": 2,
            "temperature": 1.0,
            "seed": 3,
            "stream_options": {"include_usage": True},
        },
    )
    validate_stream(chunks, include_usage=True)
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    for c in out["choices"]:
        text = "".join(
            ch["choices"][0]["delta"].get("content", "")
            for ch in chunks[:-1]
            if ch["choices"][0]["index"] == c["index"]
        )
        assert text == c["message"]["content"]


def _generated_tokens(server: Server) -> float:
    """The LLM stage's generated-token counter, once no sequence is left running there (an
    aborted one may take a step or two to go)."""
    deadline = time.monotonic() + 30
    while True:
        now = metrics(server)
        idle = now["mmcache_llm_requests_running"] + now["mmcache_llm_requests_waiting"] == 0
        if idle or time.monotonic() > deadline:
            return now["mmcache_llm_generation_tokens_total"]
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("stream", "first"),
    [(False, False), (True, False), (False, True)],
    ids=["whole", "streamed", "first_reply"],
)
def test_a_choice_ended_by_its_stop_string_stops_generating(server, baseline, stream, first) -> None:
    """With n = 2, the choice that meets its stop string is aborted at the LLM stage then (not run
    on until the other choice ends and dropped), also when its very first reply holds it; the
    answers are unchanged, with caches on and off."""
    body = {"messages": QUESTION, "temperature": 1.0, "seed": 11, "ignore_eos": True, "n": 2}
    unstopped = raw(server, {**body, "max_tokens": MAX_STOP_TOKENS, "return_token_ids": True})["choices"]
    full = [c["message"]["content"] for c in unstopped]
    # A stop string early in choice 0's text that choice 1's never holds: choice 1 runs to max_tokens.
    if first:  # choice 0's first token: it ends with the first reply
        stop = AutoTokenizer.from_pretrained(server.model).decode(unstopped[0]["token_ids"][:1])
        assert stop and stop not in full[1]
    else:
        stop = next(full[0][i : i + 4] for i in range(4, 40) if full[0][i : i + 4] not in full[1])
    request = {**body, "max_tokens": MAX_STOP_TOKENS, "stop": [stop]}
    before = _generated_tokens(server)
    if stream:
        chunks = stream_events(server, {**request, "stream_options": {"include_usage": True}})
        validate_stream(chunks, include_usage=True)
        usage = chunks[-1]["usage"]
        answers = [
            "".join(
                c["choices"][0]["delta"].get("content", "")
                for c in chunks[:-1]
                if c["choices"][0]["index"] == i
            )
            for i in range(2)
        ]
        ends = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks[:-1]}
    else:
        out = raw(server, request)
        usage = out["usage"]
        answers = [c["message"]["content"] for c in out["choices"]]
        ends = {c["index"]: c["finish_reason"] for c in out["choices"]}
    generated = _generated_tokens(server) - before
    assert ends == {0: "stop", 1: "length"}
    assert answers == [full[0][: full[0].index(stop)], full[1]]
    kept = usage["completion_tokens"] - MAX_STOP_TOKENS  # choice 0's tokens, through its stop string
    assert kept == 1 if first else 1 < kept < 40
    # Unaborted, choice 0 would run on while choice 1 generates: 2 * max_tokens in all.
    assert kept + MAX_STOP_TOKENS <= generated <= kept + MAX_STOP_TOKENS + ABORT_SLACK_TOKENS
    off = raw(baseline, request)
    assert [c["message"]["content"] for c in off["choices"]] == answers


def test_logit_bias_bans_a_token(server) -> None:
    body = {"messages": QUESTION, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    plain = raw(server, body)["choices"][0]["token_ids"]
    banned = plain[0]
    biased = raw(server, {**body, "logit_bias": {str(banned): -100}})["choices"][0]["token_ids"]
    assert banned not in biased and biased != plain


def test_penalties_change_a_sampled_answer_and_unknown_fields_are_refused(server) -> None:
    body = {"messages": QUESTION, "max_tokens": 16, "temperature": 0.0}
    plain = raw(server, body)["choices"][0]["message"]["content"]
    favoured = raw(server, {**body, "repetition_penalty": 0.3})["choices"][0]["message"]["content"]
    assert favoured != plain
    status, err = server.post(
        "/v1/chat/completions", {"model": server.model.name, **body, "prediction": {"type": "content"}}
    )
    assert status == 400 and err["error"]["param"] == "prediction"


# --- structured outputs -------------------------------------------------------------------------


def test_json_schema_twenty_sampled_outputs_validate(server) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "town", "schema": SCHEMA, "strict": True}}
    for seed in range(20):
        out = raw(
            server,
            {
                "messages": QUESTION,
                "response_format": fmt,
                "temperature": 1.0,
                "seed": seed,
                "max_tokens": 120,
            },
        )
        choice = out["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_json_object_is_an_object(server) -> None:
    out = raw(
        server,
        {
            "messages": QUESTION,
            "response_format": {"type": "json_object"},
            "max_tokens": 200,
            "temperature": 0,
        },
    )
    if out["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(out["choices"][0]["message"]["content"]), dict)
    else:  # the budget ran out inside the object: still a JSON object's beginning
        assert out["choices"][0]["message"]["content"].startswith("{")


class Street(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=10)
    shops: int = Field(ge=0, le=999)


class Town(BaseModel):
    model_config = ConfigDict(extra="forbid")
    town: str = Field(min_length=1, max_length=16)
    kind: Literal["port", "village", "city"]
    streets: list[Street] = Field(min_length=1, max_length=2)


def test_openai_parse_with_pydantic(client, server) -> None:
    out = client.chat.completions.parse(
        model=server.model.name, messages=QUESTION, response_format=Town, temperature=0, max_tokens=150
    )
    town = out.choices[0].message.parsed
    assert isinstance(town, Town) and town.kind in ("port", "village", "city")


def test_greedy_structured_answer_is_the_same_with_caches_off(server, baseline) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "town", "schema": SCHEMA}}
    body = {"messages": QUESTION, "response_format": fmt, "temperature": 0, "max_tokens": 120}
    first, second = raw(server, body), raw(server, body)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the hit is real
    cold = raw(baseline, body)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert first["choices"][0]["message"] == second["choices"][0]["message"] == cold["choices"][0]["message"]


# --- tool calls ---------------------------------------------------------------------------------


def _check_calls(calls, tools=(WEATHER, TIME)) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.parametrize(
    ("choice", "parallel"),
    [("required", False), ({"type": "function", "function": {"name": "get_time"}}, True)],
    ids=["required_one_call", "named_parallel"],
)
def test_forced_tool_calls_validate_and_stream_the_same(client, server, choice, parallel) -> None:
    kwargs = {
        "model": server.model.name,
        "messages": [{"role": "user", "content": "Weather in Paris, and the time?"}],
        "tools": [WEATHER, TIME],
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        "temperature": 0,
        "max_tokens": 200,
    }
    out = client.chat.completions.create(**kwargs)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls"
    _check_calls(message.tool_calls)
    assert message.content is None
    if not parallel:
        assert len(message.tool_calls) == 1
    if isinstance(choice, dict):
        assert {c.function.name for c in message.tool_calls} == {"get_time"}
    validate(out.model_dump(exclude_unset=True), "CreateChatCompletionResponse")

    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    for chunk in chunks:
        validate(chunk.model_dump(exclude_unset=True), "CreateChatCompletionStreamResponse")
    streamed: dict[int, dict] = {}
    fragments = 0
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.index not in streamed:  # OpenAI's first delta: id, type, name, no arguments yet
                assert delta.id and delta.type == "function" and delta.function.name
                assert delta.function.arguments == ""
            else:  # then the arguments, as the model writes them
                assert delta.id is None and delta.function.name is None
                fragments += 1
            call = streamed.setdefault(delta.index, {"name": "", "arguments": ""})
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
    assert [streamed[i] for i in sorted(streamed)] == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls
    ]
    assert fragments > 2 * len(streamed)  # not one whole call per delta
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # The call and its result go back through the template for the next turn.
    history = [
        *kwargs["messages"],
        message.model_dump(exclude_unset=True),
        *({"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in message.tool_calls),
    ]
    follow = client.chat.completions.create(
        **{**kwargs, "tool_choice": "auto", "max_tokens": 8, "messages": history}
    )
    assert follow.usage.prompt_tokens > out.usage.prompt_tokens


# --- LangChain ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_model(server):
    import langchain_openai  # a test extra: missing, this fails rather than skips

    return langchain_openai.ChatOpenAI(
        model=server.model.name,
        base_url=server.url + "/v1",
        api_key="x",
        temperature=0,
        max_tokens=200,
        max_retries=0,
        timeout=120,
    )


def test_langchain_bind_tools_with_a_forced_call(chat_model) -> None:
    bound = chat_model.bind_tools([WEATHER, TIME], tool_choice="get_weather", parallel_tool_calls=False)
    reply = bound.invoke("Weather in Paris?")
    (call,) = reply.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER["function"]["parameters"])


def test_langchain_with_structured_output(chat_model) -> None:
    town = chat_model.with_structured_output(Town, method="json_schema", strict=True).invoke(
        "Name a harbor town."
    )
    assert isinstance(town, Town)
    called = chat_model.with_structured_output(Town, method="function_calling").invoke("Name a harbor town.")
    assert isinstance(called, Town)
