"""``POST /v1/responses`` with the official ``openai`` client: images by URL (a loopback HTTP
server the SSRF guard is told to allow) and data URL, streamed and not, a two-turn
``previous_response_id`` conversation whose second turn hits the prefix cache, a forced function
call and its ``function_call_output`` round trip, ``text.format`` json_schema; every response and
stream event validates against OpenAI's published schema, and answers equal chat's."""

from __future__ import annotations

import http.server
import json
import threading

import jsonschema
import openai
import pytest

from tests import media
from tests.e2e.server import serving
from tests.openai_schema import validate

pytestmark = pytest.mark.e2e

PNG = media.image_bytes(224, 224, seed=11)
OTHER = media.image_bytes(256, 192, seed=12)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


class _Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(PNG)))
        self.end_headers()
        self.wfile.write(PNG)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def image_url():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/img.png"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def server(tiny_model):
    with serving(tiny_model, "--allowed-media-networks", "127.0.0.0/8") as srv:
        yield srv


def dump(obj) -> dict:
    """What the server sent (the client's model without the fields it fills in itself)."""
    return obj.model_dump(mode="json", exclude_unset=True, by_alias=True)


def image_input(url: str, text: str = "What is in this image?") -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": "input_image", "image_url": url}, {"type": "input_text", "text": text}],
        }
    ]


def chat_answer(client, server, url: str, text: str, max_tokens: int) -> str:
    out = client.chat.completions.create(
        model=server.model.name,
        messages=[
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}],
            }
        ],
        temperature=0,
        max_tokens=max_tokens,
    )
    return out.choices[0].message.content


def collect(stream) -> tuple[list[dict], dict]:
    """Every event, validated; and the final Response."""
    events = []
    for event in stream:
        raw = dump(event)
        validate(raw, "ResponseStreamEvent")
        events.append(raw)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created"
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    return events, events[-1]["response"]


@pytest.mark.parametrize("kind", ["url", "data_url"])
def test_an_image_streamed_and_not_equals_chat(client, server, image_url, kind) -> None:
    url = image_url if kind == "url" else media.data_url(OTHER, "image/png")
    args = {"model": server.model.name, "input": image_input(url), "temperature": 0, "max_output_tokens": 12}
    whole = client.responses.create(**args)
    validate(dump(whole), "Response")
    assert whole.status in ("completed", "incomplete")
    assert whole.output_text == chat_answer(client, server, url, "What is in this image?", 12)
    assert whole.usage.input_tokens > 64  # the image's tokens are in the prompt
    events, final = collect(client.responses.create(**args, stream=True))
    validate(final, "Response")
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == whole.output_text == final["output"][0]["content"][0]["text"]
    kinds = [e["type"] for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]


def test_two_turns_by_previous_response_id_hit_the_prefix_cache(client, server) -> None:
    url = media.data_url(media.image_bytes(224, 224, seed=13), "image/png")
    instructions = "You answer in one short sentence."
    first = client.responses.create(
        model=server.model.name,
        instructions=instructions,
        input=image_input(url),
        temperature=0,
        max_output_tokens=8,
    )
    assert first.usage.input_tokens_details.cached_tokens == 0
    second = client.responses.create(
        model=server.model.name,
        instructions=instructions,
        previous_response_id=first.id,
        input="And the colours?",
        temperature=0,
        max_output_tokens=8,
    )
    validate(dump(second), "Response")
    assert second.previous_response_id == first.id
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens - 16  # all of turn one's full blocks
    # The same conversation sent whole (full input history) is the same prompt and answer.
    history = [
        *image_input(url),
        {"role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
        {"role": "user", "content": "And the colours?"},
    ]
    again = client.responses.create(
        model=server.model.name, instructions=instructions, input=history, temperature=0, max_output_tokens=8
    )
    assert again.output_text == second.output_text
    assert again.usage.input_tokens == second.usage.input_tokens


def test_previous_response_id_is_salted_and_unknown_ids_are_404(client, server) -> None:
    first = client.responses.create(
        model=server.model.name, input="Hello", max_output_tokens=2, extra_body={"cache_salt": "tenant-a"}
    )
    for salt in ("tenant-b", None):
        extra = {"cache_salt": salt} if salt else {}
        with pytest.raises(openai.NotFoundError) as err:
            client.responses.create(
                model=server.model.name, input="Hi", previous_response_id=first.id, extra_body=extra
            )
        assert err.value.body["param"] == "previous_response_id"
    ok = client.responses.create(
        model=server.model.name,
        input="Hi",
        previous_response_id=first.id,
        max_output_tokens=2,
        extra_body={"cache_salt": "tenant-a"},
    )
    assert ok.status in ("completed", "incomplete")


@pytest.mark.parametrize("stream", [False, True])
def test_forced_function_call_and_its_output_round_trip(client, server, stream) -> None:
    args = {
        "model": server.model.name,
        "input": "What is the weather in Paris?",
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "temperature": 0,
        "max_output_tokens": 200,
    }
    if stream:
        events, response = collect(client.responses.create(**args, stream=True))
        assert "response.function_call_arguments.done" in [e["type"] for e in events]
    else:
        response = dump(client.responses.create(**args))
    validate(response, "Response")
    calls = [item for item in response["output"] if item["type"] == "function_call"]
    assert len(calls) == 1 and calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["parameters"])
    follow = client.responses.create(
        model=server.model.name,
        previous_response_id=response["id"],
        input=[{"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "sunny, 21 C"}],
        tools=[WEATHER],
        temperature=0,
        max_output_tokens=8,
    )
    validate(dump(follow), "Response")
    assert follow.usage.input_tokens > response["usage"]["input_tokens"]  # the call and its result
    assert follow.usage.input_tokens_details.cached_tokens > 0


def test_text_format_json_schema(client, server) -> None:
    schema = {
        "type": "object",
        "properties": {
            "colour": {"type": "string", "maxLength": 10},
            "count": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["colour", "count"],
        "additionalProperties": False,
    }
    out = client.responses.create(
        model=server.model.name,
        input="Describe a colour and a count as JSON.",
        text={"format": {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}},
        temperature=0,
        max_output_tokens=200,
    )
    validate(dump(out), "Response")
    assert out.status == "completed"
    jsonschema.validate(json.loads(out.output_text), schema)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"input": [{"type": "file_search_call"}]}, "input[0]"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"model": "other"}, "model"),
    ],
)
def test_what_is_not_supported_is_a_4xx_naming_the_field(server, extra, param) -> None:
    status, out = server.post("/v1/responses", {"model": server.model.name, "input": "hi", **extra})
    assert 400 <= status < 500, out
    validate(out, "ErrorResponse")
    assert out["error"]["param"] == param
