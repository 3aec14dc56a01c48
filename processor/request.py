"""Parse and validate an OpenAI chat-completions body into a :class:`ChatRequest`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from processor.errors import bad_request

ROLES = ("system", "user", "assistant")
MAX_STOP_STRINGS = 16


@dataclass(frozen=True, slots=True)
class MediaRef:
    """One image or video named by a message part (fetched later)."""

    modality: str  # "image" | "video"
    url: str | None
    uuid: str | None
    param: str  # where it came from, for error messages
    raw: memoryview | None = None  # the data: URL itself when the body held it aside (``url`` names it)

    @property
    def location(self) -> str | memoryview | None:
        """What to fetch: the URL, or the held data: URL's bytes."""
        return self.raw if self.raw is not None else self.url


@dataclass(slots=True)
class ChatRequest:
    model: str
    messages: list[dict]  # chat-template form: content parts {"type": "text"|"image"|"video"}
    media: list[MediaRef]
    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    cache_salt: str | None = None
    return_token_ids: bool = False


def parse_chat_request(body: Any, held: Mapping[str, memoryview] | None = None) -> ChatRequest:
    """``held``: the data: URLs :func:`processor.body.load_body` kept out of ``body``."""
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string", "missing_model", "model")
    messages, media = _parse_messages(body.get("messages"), held or {})
    req = ChatRequest(model=model, messages=messages, media=media, max_tokens=_max_tokens(body))
    req.temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    req.top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    req.top_k = int(_number(body, "top_k", 0, -1, 1 << 31, integer=True))
    req.top_k = max(req.top_k, 0)  # -1 (vLLM) and 0 both mean off
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 1 << 63):
        raise bad_request("'seed' must be a non-negative integer", "invalid_seed", "seed")
    req.seed = seed
    req.stop = _stop(body.get("stop"))
    req.stop_token_ids = _int_list(body, "stop_token_ids")
    req.ignore_eos = _bool(body, "ignore_eos")
    req.stream = _bool(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "invalid_stream_options", "stream_options")
    req.include_usage = bool(options.get("include_usage", False))
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise bad_request("'cache_salt' must be a non-empty string", "invalid_cache_salt", "cache_salt")
    req.cache_salt = salt
    req.return_token_ids = _bool(body, "return_token_ids")
    _unsupported(body)
    return req


def _parse_messages(raw: Any, held: Mapping[str, memoryview]) -> tuple[list[dict], list[MediaRef]]:
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty list", "missing_messages", "messages")
    messages: list[dict] = []
    media: list[MediaRef] = []
    for i, msg in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise bad_request(f"{where} must be an object", "invalid_message", where)
        role = msg.get("role")
        if role not in ROLES:
            raise bad_request(
                f"{where}.role {role!r} is not one of {', '.join(ROLES)}", "invalid_role", where
            )
        content = msg.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad_request(
                f"{where}.content must be a string or a list of parts", "invalid_content", where
            )
        parts = [
            _parse_part(part, f"{where}.content[{j}]", role, media, held) for j, part in enumerate(content)
        ]
        messages.append({"role": role, "content": parts})
    return messages, media


def _parse_part(
    part: Any, where: str, role: str, media: list[MediaRef], held: Mapping[str, memoryview]
) -> dict:
    if not isinstance(part, dict):
        raise bad_request(f"{where} must be an object", "invalid_content_part", where)
    kind = part.get("type")
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_request(f"{where}.text must be a string", "invalid_content_part", where)
        return {"type": "text", "text": text}
    if kind in ("image_url", "video_url"):
        modality = kind.removesuffix("_url")
        if role != "user":
            raise bad_request(
                f"{where}: {kind} parts are only allowed in user messages", "invalid_content_part", where
            )
        ref = part.get(kind)
        url = ref.get("url") if isinstance(ref, dict) else ref
        uuid = part.get("uuid")
        if url is not None and not isinstance(url, str):
            raise bad_request(f"{where}.{kind}.url must be a string", "invalid_media_url", where)
        if uuid is not None and (not isinstance(uuid, str) or not uuid):
            raise bad_request(f"{where}.uuid must be a non-empty string", "invalid_uuid", where)
        if not url and uuid is None:
            raise bad_request(f"{where} needs {kind}.url (or a uuid)", "invalid_media_url", where)
        media.append(MediaRef(modality, url or None, uuid, where, held.get(url) if url else None))
        return {"type": modality}
    raise bad_request(
        f"{where}.type {kind!r} is not supported (text, image_url, video_url)",
        "invalid_content_part_type",
        where,
    )


def _max_tokens(body: dict) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise bad_request(f"'{name}' must be an integer >= 1, got {value!r}", "invalid_max_tokens", name)
        return value
    return None


def _number(
    body: dict,
    name: str,
    default: float,
    low: float,
    high: float,
    *,
    low_open: bool = False,
    integer: bool = False,
) -> float:
    value = body.get(name)
    if value is None:
        return default
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not ok_type or isinstance(value, bool):
        raise bad_request(f"'{name}' must be a number", f"invalid_{name}", name)
    if not math.isfinite(value) or value < low or value > high or (low_open and value == low):
        bounds = f"{'(' if low_open else '['}{low}, {high}]"
        raise bad_request(f"'{name}' must be in {bounds}, got {value}", f"invalid_{name}", name)
    return value


def _bool(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean", f"invalid_{name}", name)
    return value


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("'stop' must be a non-empty string or a list of them", "invalid_stop", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' takes at most {MAX_STOP_STRINGS} strings", "invalid_stop", "stop")
    return stops


def _int_list(body: dict, name: str) -> list[int]:
    value = body.get(name) or []
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise bad_request(f"'{name}' must be a list of integers", f"invalid_{name}", name)
    return value


def _unsupported(body: dict) -> None:
    n = body.get("n", 1)
    if n != 1:
        raise bad_request("only n=1 is supported", "unsupported_n", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise bad_request(f"'{name}' is not supported", "unsupported_parameter", name)
    if body.get("logprobs") or body.get("top_logprobs"):
        raise bad_request("logprobs are not supported", "unsupported_parameter", "logprobs")
    if body.get("tools"):
        raise bad_request("tools are not supported", "unsupported_parameter", "tools")


__all__ = ["ChatRequest", "MediaRef", "parse_chat_request"]
