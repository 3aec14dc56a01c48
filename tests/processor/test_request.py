"""parse_chat_request: valid OpenAI bodies parse; each invalid one is a 400 naming param and code."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from mmcache.processor.errors import APIError
from mmcache.processor.pipeline import sampling_params
from mmcache.processor.request import MediaRef, parse_chat_request

IMG = "data:image/png;base64,iVBORw0KGgo="


def body(**extra: Any) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **extra}


def reject(payload: Any) -> APIError:
    with pytest.raises(APIError) as info:
        parse_chat_request(payload)
    assert info.value.status == 400
    return info.value


# --- accepted --------------------------------------------------------------------------


def test_minimal_body_and_defaults():
    req = parse_chat_request(body())
    assert req.model == "tiny"
    assert req.messages == [{"role": "user", "content": "hi"}]
    assert req.media == []
    assert req.max_tokens is None
    assert (req.temperature, req.top_p, req.top_k, req.seed) == (1.0, 1.0, 0, None)
    assert req.stop == [] and req.stop_token_ids == []
    assert not req.stream and not req.include_usage and not req.ignore_eos
    assert req.cache_salt is None


def test_content_parts_with_image_url_object_and_string_and_video():
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "compare"},
                {"type": "image_url", "image_url": {"url": IMG}},
                {"type": "image_url", "image_url": "https://example.com/a.png"},
                {"type": "video_url", "video_url": {"url": "file:///media/clip.mp4"}},
                {"type": "image_url", "image_url": {"url": IMG}, "uuid": "img-7"},
                {"type": "image_url", "uuid": "img-8"},
            ],
        },
        {"role": "assistant", "content": None},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
    ]
    req = parse_chat_request(body(messages=messages))
    assert req.messages == [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "compare"},
                {"type": "image"},
                {"type": "image"},
                {"type": "video"},
                {"type": "image"},
                {"type": "image"},
            ],
        },
        {"role": "assistant", "content": ""},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
    ]
    where = "messages[1].content"
    assert req.media == [
        MediaRef("image", IMG, None, f"{where}[1]"),
        MediaRef("image", "https://example.com/a.png", None, f"{where}[2]"),
        MediaRef("video", "file:///media/clip.mp4", None, f"{where}[3]"),
        MediaRef("image", IMG, "img-7", f"{where}[4]"),
        MediaRef("image", None, "img-8", f"{where}[5]"),
    ]


def test_max_completion_tokens_and_max_tokens():
    assert parse_chat_request(body(max_tokens=7)).max_tokens == 7
    assert parse_chat_request(body(max_completion_tokens=9)).max_tokens == 9
    # The newer name wins when both are given.
    assert parse_chat_request(body(max_completion_tokens=9, max_tokens=3)).max_tokens == 9
    assert parse_chat_request(body(max_tokens=None)).max_tokens is None


def test_stop_string_and_list():
    assert parse_chat_request(body(stop="END")).stop == ["END"]
    assert parse_chat_request(body(stop=["a", "bb"])).stop == ["a", "bb"]
    assert parse_chat_request(body(stop=None)).stop == []
    assert parse_chat_request(body(stop=[f"s{i}" for i in range(16)])).stop[-1] == "s15"


def test_stream_and_stream_options():
    req = parse_chat_request(body(stream=True, stream_options={"include_usage": True}))
    assert req.stream and req.include_usage
    req = parse_chat_request(body(stream=True, stream_options=None))
    assert req.stream and not req.include_usage
    assert not parse_chat_request(body(stream_options={})).include_usage


def test_sampling_parameters():
    req = parse_chat_request(
        body(temperature=0, top_p=0.5, top_k=40, seed=123, stop_token_ids=[5, 6], ignore_eos=True)
    )
    assert (req.temperature, req.top_p, req.top_k, req.seed) == (0, 0.5, 40, 123)
    assert req.stop_token_ids == [5, 6] and req.ignore_eos
    assert parse_chat_request(body(top_k=-1)).top_k == 0  # vLLM's "off"
    assert parse_chat_request(body(temperature=2.0, top_p=1)).temperature == 2.0
    assert parse_chat_request(body(seed=0)).seed == 0


def test_cache_salt_and_extras():
    req = parse_chat_request(body(cache_salt="tenant-a", return_token_ids=True, n=1, presence_penalty=0))
    assert req.cache_salt == "tenant-a" and req.return_token_ids


def test_parse_does_not_mutate_the_body():
    payload = body(
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": IMG}]}], stop="x"
    )
    before = copy.deepcopy(payload)
    parse_chat_request(payload)
    assert payload == before


# --- rejected --------------------------------------------------------------------------

PART = "messages[0].content[0]"

INVALID = [
    # (name, body, param, code)
    ("not_object", [1, 2], None, "invalid_request"),
    ("no_model", {"messages": [{"role": "user", "content": "x"}]}, "model", "missing_model"),
    ("empty_model", body(model=""), "model", "missing_model"),
    ("model_not_str", body(model=5), "model", "missing_model"),
    ("no_messages", {"model": "m"}, "messages", "missing_messages"),
    ("empty_messages", body(messages=[]), "messages", "missing_messages"),
    ("messages_not_list", body(messages={"role": "user"}), "messages", "missing_messages"),
    ("message_not_object", body(messages=["hi"]), "messages[0]", "invalid_message"),
    ("bad_role", body(messages=[{"role": "robot", "content": "x"}]), "messages[0]", "invalid_role"),
    ("no_role", body(messages=[{"content": "x"}]), "messages[0]", "invalid_role"),
    ("content_number", body(messages=[{"role": "user", "content": 3}]), "messages[0]", "invalid_content"),
    ("content_none_user", body(messages=[{"role": "user"}]), "messages[0]", "invalid_content"),
    ("part_not_object", body(messages=[{"role": "user", "content": ["x"]}]), PART, "invalid_content_part"),
    (
        "part_type",
        body(messages=[{"role": "user", "content": [{"type": "audio_url"}]}]),
        PART,
        "invalid_content_part_type",
    ),
    (
        "text_not_str",
        body(messages=[{"role": "user", "content": [{"type": "text", "text": 1}]}]),
        PART,
        "invalid_content_part",
    ),
    (
        "image_in_system",
        body(messages=[{"role": "system", "content": [{"type": "image_url", "image_url": IMG}]}]),
        PART,
        "invalid_content_part",
    ),
    (
        "image_without_url",
        body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        PART,
        "invalid_media_url",
    ),
    (
        "image_url_empty",
        body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": ""}]}]),
        PART,
        "invalid_media_url",
    ),
    (
        "image_url_not_str",
        body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 5}}]}]),
        PART,
        "invalid_media_url",
    ),
    (
        "empty_uuid",
        body(messages=[{"role": "user", "content": [{"type": "video_url", "uuid": ""}]}]),
        PART,
        "invalid_uuid",
    ),
    ("max_tokens_zero", body(max_tokens=0), "max_tokens", "invalid_max_tokens"),
    ("max_tokens_float", body(max_tokens=2.5), "max_tokens", "invalid_max_tokens"),
    ("max_tokens_bool", body(max_tokens=True), "max_tokens", "invalid_max_tokens"),
    ("max_completion_neg", body(max_completion_tokens=-3), "max_completion_tokens", "invalid_max_tokens"),
    ("temperature_high", body(temperature=2.5), "temperature", "invalid_temperature"),
    ("temperature_neg", body(temperature=-0.1), "temperature", "invalid_temperature"),
    ("temperature_str", body(temperature="hot"), "temperature", "invalid_temperature"),
    ("temperature_nan", body(temperature=float("nan")), "temperature", "invalid_temperature"),
    ("top_p_zero", body(top_p=0), "top_p", "invalid_top_p"),
    ("top_p_nan", body(top_p=float("nan")), "top_p", "invalid_top_p"),
    ("top_p_high", body(top_p=1.5), "top_p", "invalid_top_p"),
    ("top_k_float", body(top_k=1.5), "top_k", "invalid_top_k"),
    ("top_k_below", body(top_k=-2), "top_k", "invalid_top_k"),
    ("seed_neg", body(seed=-1), "seed", "invalid_seed"),
    ("seed_str", body(seed="7"), "seed", "invalid_seed"),
    ("seed_bool", body(seed=True), "seed", "invalid_seed"),
    ("stop_empty_str", body(stop=""), "stop", "invalid_stop"),
    ("stop_number", body(stop=5), "stop", "invalid_stop"),
    ("stop_list_mixed", body(stop=["a", 1]), "stop", "invalid_stop"),
    ("stop_too_many", body(stop=[f"s{i}" for i in range(17)]), "stop", "invalid_stop"),
    ("stop_ids_str", body(stop_token_ids=["1"]), "stop_token_ids", "invalid_stop_token_ids"),
    ("stop_ids_not_list", body(stop_token_ids=5), "stop_token_ids", "invalid_stop_token_ids"),
    ("stream_str", body(stream="yes"), "stream", "invalid_stream"),
    ("ignore_eos_int", body(ignore_eos=1), "ignore_eos", "invalid_ignore_eos"),
    ("stream_options_list", body(stream_options=[1]), "stream_options", "invalid_stream_options"),
    ("cache_salt_empty", body(cache_salt=""), "cache_salt", "invalid_cache_salt"),
    ("cache_salt_int", body(cache_salt=3), "cache_salt", "invalid_cache_salt"),
    ("n_zero", body(n=0), "n", "invalid_n"),
    ("n_too_many", body(n=17), "n", "invalid_n"),
    ("presence_penalty", body(presence_penalty=2.5), "presence_penalty", "invalid_presence_penalty"),
    ("frequency_penalty", body(frequency_penalty="1"), "frequency_penalty", "invalid_frequency_penalty"),
    ("repetition_penalty", body(repetition_penalty=0), "repetition_penalty", "invalid_repetition_penalty"),
    ("logit_bias_key", body(logit_bias={"x": 1}), "logit_bias", "invalid_logit_bias"),
    ("logit_bias_value", body(logit_bias={"3": 101}), "logit_bias", "invalid_logit_bias"),
    ("min_tokens", body(min_tokens=9, max_tokens=4), "min_tokens", "invalid_min_tokens"),
    ("logprobs_int", body(logprobs=1), "logprobs", "invalid_logprobs"),
    ("top_logprobs_alone", body(top_logprobs=3), "top_logprobs", "invalid_top_logprobs"),
    ("top_logprobs_21", body(logprobs=True, top_logprobs=21), "top_logprobs", "invalid_top_logprobs"),
    ("prompt_logprobs_all", body(prompt_logprobs=-1), "prompt_logprobs", "invalid_prompt_logprobs"),
    ("prompt_logprobs_str", body(prompt_logprobs="2"), "prompt_logprobs", "invalid_prompt_logprobs"),
    ("audio", body(audio={"voice": "x"}), "audio", "unsupported_parameter"),
    ("function_call", body(function_call="auto"), "function_call", "unsupported_parameter"),
    ("tools_bad", body(tools=[{"type": "function"}]), "tools[0]", "invalid_tools"),
    ("tools_empty", body(tools=[]), "tools", "invalid_tools"),
    ("tool_choice_alone", body(tool_choice="required"), "tool_choice", "invalid_tool_choice"),
    (
        "tool_choice_unknown",
        body(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        "tool_choice",
        "invalid_tool_choice",
    ),
    (
        "response_format_type",
        body(response_format={"type": "xml"}),
        "response_format",
        "invalid_response_format",
    ),
    (
        "response_format_schema",
        body(
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}
        ),
        "response_format",
        "invalid_json_schema",
    ),
    (
        "bad_tool_call_args",
        body(
            messages=[
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{"}}
                    ],
                },
            ]
        ),
        "messages[1]",
        "invalid_message",
    ),
]


@pytest.mark.parametrize("payload, param, code", [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_bodies_name_param_and_code(payload, param, code):
    err = reject(payload)
    assert err.code == code
    assert err.param == param
    assert err.message  # a human-readable reason


def test_logprob_fields_are_parsed():
    req = parse_chat_request(body(logprobs=True, top_logprobs=5, prompt_logprobs=0))
    assert (req.logprobs, req.top_logprobs, req.prompt_logprobs) == (True, 5, 0)
    req = parse_chat_request(body(logprobs=False, top_logprobs=0))  # what some clients send
    assert (req.logprobs, req.top_logprobs, req.prompt_logprobs) == (False, 0, None)


def test_sampling_controls_and_roles_are_parsed():
    req = parse_chat_request(
        body(
            messages=[
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sunny"}]},
            ],
            n=3,
            seed=5,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            repetition_penalty=1.2,
            logit_bias={"17": -100, "3": 2.5},
            min_tokens=2,
            response_format={"type": "json_object"},
        )
    )
    assert [m["role"] for m in req.messages] == ["system", "user", "assistant", "tool"]
    assert req.messages[2]["tool_calls"] == [
        {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    ]
    assert req.messages[3]["content"] == "sunny"
    assert (req.n, req.presence_penalty, req.frequency_penalty, req.repetition_penalty) == (3, 0.5, -0.5, 1.2)
    assert req.logit_bias == {17: -100.0, 3: 2.5} and req.min_tokens == 2
    assert req.grammar is not None and req.tools is None
    sampling = [sampling_params(req, 10, 100, i) for i in range(3)]
    assert [s.seed for s in sampling] == [5, 6, 7]  # one seed per choice
    assert sampling[0].grammar == req.grammar and sampling[0].logit_bias == {17: -100.0, 3: 2.5}


def test_tool_choice_required_constrains_and_none_drops_the_tools():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert parse_chat_request(body(tools=tools)).grammar is None  # auto: free text
    required = parse_chat_request(body(tools=tools, tool_choice="required"))
    assert required.grammar is not None and required.tools.constrained[0]["name"] == "f"
    assert parse_chat_request(body(tools=tools, tool_choice="none")).tools is None


def test_error_names_the_failing_message_and_part():
    messages = [
        {"role": "user", "content": "fine"},
        {"role": "user", "content": [{"type": "text", "text": "ok"}, {"type": "image_url", "image_url": {}}]},
    ]
    err = reject(body(messages=messages))
    assert err.param == "messages[1].content[1]"
    assert "messages[1].content[1]" in err.message


def test_error_response_body_is_openai_shaped():
    err = reject(body(top_p=0))
    resp = err.response()
    assert resp.status == 400
    payload = json.loads(resp.body)
    assert payload["error"]["code"] == "invalid_top_p"
    assert payload["error"]["param"] == "top_p"
    assert payload["error"]["type"] == "invalid_request_error"
    assert "top_p" in payload["error"]["message"]
