"""OpenAI's Responses API (``POST /v1/responses``), translated to a chat request.

``input`` (a string, or items: messages with ``input_text`` / ``input_image`` parts, earlier
``function_call`` items and their ``function_call_output``), ``instructions`` and the turns of
a ``previous_response_id`` become chat messages; ``tools``, ``tool_choice`` and ``text.format``
become chat's tools and response format; the request then runs as a chat completion does
(:mod:`mmcache.processor.responses_render` renders the answer as a Response).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mmcache.processor.errors import APIError, bad_request
from mmcache.processor.request import ChatRequest, parse_chat_request
from mmcache.processor.response_store import ResponseStore

# Request fields this server reads; any other field that is set is refused with a 400 naming it.
SUPPORTED = {
    "model",
    "input",
    "instructions",
    "previous_response_id",
    "stream",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "max_output_tokens",
    "temperature",
    "top_p",
    "store",
    "metadata",
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "cache_salt",
    "seed",
}
# Fields accepted only at the value that changes nothing.
NEUTRAL = {
    "background": (False,),
    "truncation": ("disabled",),
    "service_tier": ("auto", "default"),
    "include": ([],),
    "reasoning": ({},),
}
MAX_METADATA = 16


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    chat: ChatRequest
    body: dict  # what the Response echoes (instructions, tools, tool_choice, text …)
    history: list[dict]  # chat-form turns without the instructions (what is stored)
    store: bool


def parse_responses(body: Any, held: Mapping[str, memoryview], store: ResponseStore) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    for name, value in body.items():
        if value is None or name in SUPPORTED:
            continue
        if name in NEUTRAL and value in NEUTRAL[name]:
            continue
        raise bad_request(
            f"'{name}' is not supported by this server's /v1/responses", "unsupported_parameter", name
        )
    salt = body.get("cache_salt")
    history: list[dict] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str):
            raise bad_request(
                "'previous_response_id' must be a string",
                "invalid_previous_response_id",
                "previous_response_id",
            )
        stored = store.get(previous, salt if isinstance(salt, str) else None)
        if stored is None:
            raise APIError(
                404,
                f"previous response {previous!r} is not stored (unknown, expired, or another cache_salt)",
                "previous_response_not_found",
                "previous_response_id",
            )
        history = list(stored)
    history += _input(body.get("input"), held)
    messages = list(history)
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("'instructions' must be a string", "invalid_instructions", "instructions")
        messages.insert(0, {"role": "system", "content": instructions})
    chat_body: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    for name in ("temperature", "top_p", "seed", "cache_salt", "parallel_tool_calls", "stream"):
        if body.get(name) is not None:
            chat_body[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat_body["max_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat_body["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat_body["tool_choice"] = _tool_choice(body["tool_choice"])
    text = body.get("text")
    if text is not None:
        chat_body["response_format"] = _format(text)
    _metadata(body.get("metadata"))
    keep = body.get("store", True)
    if not isinstance(keep, bool):
        raise bad_request("'store' must be a boolean", "invalid_store", "store")
    try:
        chat = parse_chat_request(chat_body, held)
    except APIError as exc:
        raise _renamed(exc) from exc
    return ResponsesRequest(chat, body, history, keep)


def _renamed(exc: APIError) -> APIError:
    """A chat error names chat's field; name the Responses field instead."""
    names = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}
    param = names.get(exc.param or "", exc.param)
    if param and param.startswith("messages["):
        param = "input"
    message = exc.message
    for old, new in names.items():
        message = message.replace(f"'{old}'", f"'{new}'")
    return APIError(exc.status, message, exc.code, param)


def _input(raw: Any, held: Mapping[str, memoryview]) -> list[dict]:
    """``input`` as chat messages (consecutive function calls join one assistant turn)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad_request("'input' must be a string or a non-empty list of items", "invalid_input", "input")
    out: list[dict] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", "invalid_input", where)
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, where, held))
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not all(isinstance(v, str) for v in (name, args, call_id)):
                raise bad_request(
                    f"{where}: a function_call needs name, arguments and call_id strings",
                    "invalid_input",
                    where,
                )
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str) or not isinstance(item.get("call_id"), str):
                raise bad_request(
                    f"{where}: a function_call_output needs call_id and output strings",
                    "invalid_input",
                    where,
                )
            out.append({"role": "tool", "content": output, "tool_call_id": item["call_id"]})
        else:
            raise bad_request(
                f"{where}.type {kind!r} is not supported (message, function_call, function_call_output)",
                "unsupported_parameter",
                where,
            )
    return out


def _message(item: dict, where: str, held: Mapping[str, memoryview]) -> dict:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise bad_request(
            f"{where}.role {role!r} is not one of user, system, developer, assistant", "invalid_input", where
        )
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of parts", "invalid_input", where)
    parts: list[dict] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image":
            url, file_id = part.get("image_url"), part.get("file_id")
            if isinstance(url, str) and url:
                parts.append({"type": "image_url", "image_url": {"url": _text(url, held)}})
            elif isinstance(file_id, str) and file_id:  # NOTE: our media references: a uuid the cache knows
                parts.append({"type": "image_url", "uuid": file_id})
            else:
                raise bad_request(
                    f"{at} needs image_url (a URL or data: URL) or file_id", "invalid_input", at
                )
        elif kind == "input_video":  # NOTE: not OpenAI's; as chat's video_url part
            url = part.get("video_url")
            if not isinstance(url, str) or not url:
                raise bad_request(f"{at} needs video_url", "invalid_input", at)
            parts.append({"type": "video_url", "video_url": {"url": _text(url, held)}})
        elif kind == "refusal":
            parts.append({"type": "text", "text": str(part.get("refusal", ""))})
        else:
            raise bad_request(
                f"{at}.type {kind!r} is not supported (input_text, input_image, input_video, output_text)",
                "unsupported_parameter",
                at,
            )
    return {"role": role, "content": parts}


def _text(url: str, held: Mapping[str, memoryview]) -> str:
    """A URL as text, a held data: URL included (what the store keeps; parsing holds it again)."""
    data = held.get(url)
    return url if data is None else str(data, "utf-8")


def _tools(raw: Any) -> list[dict]:
    if not isinstance(raw, list):
        raise bad_request("'tools' must be a list", "invalid_tools", "tools")
    out = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(
                f"tools[{i}]: tool type {kind!r} is not supported (function only)",
                "unsupported_parameter",
                f"tools[{i}]",
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(raw: Any) -> Any:
    if raw in ("none", "auto", "required"):
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("name"), str):
        return {"type": "function", "function": {"name": raw["name"]}}
    raise bad_request(
        '\'tool_choice\' must be none, auto, required or {"type": "function", "name": ...}',
        "invalid_tool_choice",
        "tool_choice",
    )


def _format(text: Any) -> dict | None:
    if not isinstance(text, dict):
        raise bad_request("'text' must be an object", "invalid_text", "text")
    for name in text:
        if name not in ("format", "verbosity"):
            raise bad_request(f"'text.{name}' is not supported", "unsupported_parameter", f"text.{name}")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("'text.format' must be an object", "invalid_text", "text.format")
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return {"type": fmt.get("type")}


def _metadata(value: Any) -> None:
    if value is None:
        return
    if (
        not isinstance(value, dict)
        or len(value) > MAX_METADATA
        or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
            for k, v in value.items()
        )
    ):
        raise bad_request(
            f"'metadata' must map at most {MAX_METADATA} keys (≤ 64 characters) to strings (≤ 512)",
            "invalid_metadata",
            "metadata",
        )
