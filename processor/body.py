"""Request bodies with their large ``data:`` URLs held aside as raw bytes.

Chat clients resend every image of a conversation on every turn, as base64 ``data:``
URLs: megabytes of JSON that a parser would copy into Python strings each time, only
for the processor to hash them and find the image cached. Each JSON string that is a
large ``data:`` URL without escapes is therefore cut out of the raw body before it is
parsed, and stands in the parsed body as a placeholder naming the raw bytes
(:data:`HeldUrls`). A placeholder anywhere but a ``url`` value is put back as text, so
the parsed body reads as before. The cut is only made where JSON leaves no doubt: an
unescaped quote followed by ``data:``, the next quote closing a string without any
backslash, and no colon after it (a value, not a key).
"""

from __future__ import annotations

import secrets
from typing import Any

import orjson

from mmcache.processor.errors import bad_request

HeldUrls = dict[str, memoryview]  # placeholder → the URL's raw bytes, as sent

MIN_HELD_BYTES = 4096  # smaller data: URLs are parsed as usual
_START = b'"data:'
_BLANK = b" \t\r\n"


def load_body(raw: bytes) -> tuple[Any, HeldUrls]:
    """The parsed JSON body, with its large ``data:`` URLs held aside (see the module)."""
    held: HeldUrls = {}
    if raw.find(_START) < 0:
        return _loads(raw), held
    nonce = secrets.token_hex(8)
    view = memoryview(raw)
    out = bytearray()
    last = pos = 0
    while (i := raw.find(_START, pos)) >= 0:
        j = raw.find(b'"', i + 1)
        if j < 0:
            break
        if _escaped(raw, i) or raw.find(b"\\", i, j) >= 0:
            pos = i + 1  # inside a string, or a string with escapes: the parser's job
            continue
        pos = j + 1
        if j - i - 1 < MIN_HELD_BYTES or _is_key(raw, j + 1):
            continue
        name = f"\x00data-url:{nonce}:{len(held)}"
        held[name] = view[i + 1 : j]
        out += view[last:i]
        out += orjson.dumps(name)
        last = j + 1
    if not held:
        return _loads(raw), held
    out += view[last:]
    body = _loads(out)
    _put_back(body, held)
    return body, held


def _loads(data: bytes | bytearray) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", "invalid_json") from exc


def _escaped(raw: bytes, quote: int) -> bool:
    """Is the quote at ``quote`` preceded by an odd run of backslashes (part of a string)?"""
    n = 0
    while quote - n > 0 and raw[quote - n - 1] == 0x5C:
        n += 1
    return n % 2 == 1


def _is_key(raw: bytes, after: int) -> bool:
    while after < len(raw) and raw[after] in _BLANK:
        after += 1
    return raw[after : after + 1] == b":"


def _put_back(node: Any, held: HeldUrls) -> None:
    """Every placeholder that is not a ``url`` value becomes its text again."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        if isinstance(value, str):
            if value in held and key != "url":
                node[key] = _text(held[value])
        elif isinstance(value, (dict, list)):
            _put_back(value, held)


def _text(data: memoryview) -> str:
    try:
        return str(data, "utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", "invalid_json") from exc
