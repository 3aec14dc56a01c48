"""Parse and validate an OpenAI chat-completions body into a :class:`ChatRequest`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mmcache.processor.errors import bad_request
from mmcache.processor.structured import response_format_grammar, tool_call_grammar
from mmcache.processor.tools import Tools, parse_tools, template_tool_calls

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP_STRINGS = 16
MAX_N = 16  # most choices one request may ask for
MAX_LOGIT_BIAS = 300  # most entries in logit_bias (OpenAI's limit)
MAX_LOGPROBS = 20  # most top_logprobs / prompt_logprobs entries (OpenAI's limit)
# Fields OpenAI's API defines that change the answer and that this server does not implement: a 400
# names them rather than answering as if they were absent.
UNSUPPORTED = ("audio", "modalities", "prediction", "web_search_options", "functions", "function_call")


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
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    grammar: str | None = None  # llguidance grammar the answer must follow (structured output, tools)
    tools: Tools | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and the top k


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
    req.n = int(_number(body, "n", 1, 1, MAX_N, integer=True))
    req.presence_penalty = _number(body, "presence_penalty", 0.0, -2.0, 2.0)
    req.frequency_penalty = _number(body, "frequency_penalty", 0.0, -2.0, 2.0)
    req.repetition_penalty = _number(body, "repetition_penalty", 1.0, 0.0, 10.0, low_open=True)
    req.logit_bias = _logit_bias(body.get("logit_bias"))
    req.min_tokens = int(_number(body, "min_tokens", 0, 0, 1 << 31, integer=True))
    if req.max_tokens is not None and req.min_tokens > req.max_tokens:
        raise bad_request("'min_tokens' must not exceed max_tokens", "invalid_min_tokens", "min_tokens")
    _logprobs(body, req)
    req.grammar = response_format_grammar(body.get("response_format"))
    req.tools = parse_tools(body)
    if req.tools is not None and req.tools.choice == "none":
        req.tools = None  # NOTE: OpenAI then answers in text, as if no tools were given
    if req.tools is not None and req.tools.constrained:
        if req.grammar is not None:
            raise bad_request(
                "'response_format' and a required tool_choice cannot both constrain the answer",
                "invalid_tool_choice",
                "tool_choice",
            )
        req.grammar = tool_call_grammar(req.tools.constrained, req.tools.parallel)
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
        if role == "developer":
            role = "system"  # OpenAI's newer name for the system turn
        content = msg.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, str):
            out: dict = {"role": role, "content": content}
        elif isinstance(content, list):
            parts = [
                _parse_part(part, f"{where}.content[{j}]", role, media, held)
                for j, part in enumerate(content)
            ]
            out = {"role": role, "content": parts}
            if role == "tool":  # templates render a tool result as text
                out["content"] = "".join(p.get("text", "") for p in parts)
        else:
            raise bad_request(
                f"{where}.content must be a string or a list of parts", "invalid_content", where
            )
        if role == "assistant" and msg.get("tool_calls"):
            out["tool_calls"] = template_tool_calls(msg["tool_calls"], where)
        messages.append(out)
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


def _logit_bias(value: Any) -> dict[int, float]:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise bad_request(
            f"'logit_bias' must map at most {MAX_LOGIT_BIAS} token ids to numbers",
            "invalid_logit_bias",
            "logit_bias",
        )
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            token = int(key)  # JSON object keys are strings
        except (TypeError, ValueError):
            token = -1
        if (
            token < 0
            or not isinstance(bias, (int, float))
            or isinstance(bias, bool)
            or not -100 <= bias <= 100
        ):
            raise bad_request(
                f"logit_bias[{key!r}]: keys are token ids, values numbers in [-100, 100]",
                "invalid_logit_bias",
                "logit_bias",
            )
        out[token] = float(bias)
    return out


def _logprobs(body: dict, req: ChatRequest) -> None:
    req.logprobs = _bool(body, "logprobs") if body.get("logprobs") is not None else False
    top = body.get("top_logprobs")
    if top is not None:
        req.top_logprobs = int(_number(body, "top_logprobs", 0, 0, MAX_LOGPROBS, integer=True))
        if req.top_logprobs and not req.logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs': true", "invalid_top_logprobs", "top_logprobs")
    if body.get("prompt_logprobs") is not None:
        # NOTE: vLLM's -1 (the whole vocabulary) is refused: its size would be unbounded in practice.
        req.prompt_logprobs = int(_number(body, "prompt_logprobs", 0, 0, MAX_LOGPROBS, integer=True))


def _unsupported(body: dict) -> None:
    for name in UNSUPPORTED:
        if body.get(name) is not None:
            raise bad_request(f"'{name}' is not supported", "unsupported_parameter", name)


__all__ = ["ChatRequest", "MediaRef", "parse_chat_request"]
