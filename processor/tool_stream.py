"""The model's ``<tool_call>`` blocks as OpenAI tool calls, whole or streamed as they are written.

Qwen's blocks hold ``{"name": ..., "arguments": {...}}``. Streamed the way OpenAI does it: once
``<tool_call>{"name": "..."`` has been read, a first delta with the call's id, type, name and
``arguments: ""``; then the text of the arguments value as it arrives (exactly the model's
characters, so the fragments concatenate to the call's ``arguments``); the answer is the same
whichever pieces the text came in, and the whole-answer path runs the same parser.

A block ends at the first ``</tool_call>`` (as a non-greedy match would). A block that does not
begin with the name (another key order, or not JSON) is held until it closes and then is one
whole call, or text if it is not a call object. A call whose name was read stays a call even if
its JSON breaks later or the block never closes (generation ended): its arguments are then the
text written so far, as OpenAI's may be invalid JSON too.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Literal

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")  # the first present holds the call's arguments
_WS = " \t\r\n"


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str = ""  # JSON text, as OpenAI sends it

    def as_dict(self, index: int | None = None) -> dict:
        out: dict = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out["index"] = index
        return out


@dataclass(slots=True)
class CallDelta:
    """One entry of a stream chunk's ``delta.tool_calls``: a call's start, or more of its arguments."""

    index: int
    arguments: str
    call: ToolCall | None = None  # set on the call's first delta

    def as_dict(self) -> dict:
        if self.call is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            **self.call.as_dict(self.index),
            "function": {"name": self.call.name, "arguments": self.arguments},
        }


def split_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """The text outside ``<tool_call>`` blocks and the calls the blocks hold (a block that is not a
    call stays in the text)."""
    stream = ToolStream()
    content, _ = stream.feed(text, final=True)
    return (content.strip(), stream.calls) if stream.calls else (text, [])


def _new_call(name: str, arguments: str = "") -> ToolCall:
    return ToolCall("call_" + uuid.uuid4().hex[:24], name, arguments)


def _whole_call(payload: str) -> ToolCall | None:
    """A block read whole (its name did not come first): a call object, or None."""
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: object = next((obj[k] for k in ARGUMENT_KEYS if k in obj), {})
    return _new_call(obj["name"], json.dumps(args, ensure_ascii=False))


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _header(text: str) -> tuple[str, int] | Literal[False] | None:
    """``{"name": "<name>"`` at the start of ``text`` (whitespace allowed): (name, end), None while
    ``text`` is a prefix of one, False when it cannot become one."""
    i = 0
    for literal in ("{", '"name"', ":"):
        while i < len(text) and text[i] in _WS:
            i += 1
        got = text[i : i + len(literal)]
        if not literal.startswith(got):
            return False
        if len(got) < len(literal):
            return None
        i += len(literal)
    while i < len(text) and text[i] in _WS:
        i += 1
    if i == len(text):
        return None
    if text[i] != '"':
        return False
    j = i + 1
    while j < len(text) and text[j] != '"':
        j += 2 if text[j] == "\\" else 1
    if j >= len(text):
        return None
    try:
        return json.loads(text[i : j + 1]), j + 1
    except json.JSONDecodeError:
        return False


@dataclass(slots=True)
class _Scan:
    """Where the scan of an open call's object is, one character at a time (after its name)."""

    state: str = "object"  # object | key_start | key | colon | value_start | value | string | scalar | skip
    key: str = ""
    emitting: bool = False  # the value being read is the call's arguments
    has_arguments: bool = False
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    out: list[str] = field(default_factory=list)


class ToolStream:
    """Streamed text split into content and tool-call deltas (:class:`CallDelta`).

    Text that could still be the start of ``<tool_call>`` is held back, so no part of a block
    ever leaves as content; so are newlines just before one (the template puts them around blocks).
    """

    def __init__(self) -> None:
        self._buf = ""
        self._state = "out"  # out | head | whole | call
        self._newlines = ""  # newlines held before the open block: text again if it is not a call
        self._after_block = False  # newlines right after a call's block are not content
        self._scan = _Scan()
        self.calls: list[ToolCall] = []

    def feed(self, text: str, final: bool = False) -> tuple[str, list[CallDelta]]:
        self._buf += text
        content: list[str] = []
        deltas: list[CallDelta] = []
        while self._step(content, deltas, final):
            pass
        merged: list[CallDelta] = []
        for d in deltas:  # a call's fragments together; its start stays apart (arguments "")
            if merged and merged[-1].index == d.index and d.call is None and merged[-1].call is None:
                merged[-1].arguments += d.arguments
            else:
                merged.append(d)
        return "".join(content), merged

    def _step(self, content: list[str], deltas: list[CallDelta], final: bool) -> bool:
        """Process what can be decided now; False when more text is needed (or none is left)."""
        return getattr(self, "_" + self._state)(self._buf, content, deltas, final)

    def _out(self, buf: str, content: list[str], deltas: list[CallDelta], final: bool) -> bool:
        """Content, up to the next ``<tool_call>``."""
        if self._after_block:
            buf = self._buf = buf.lstrip("\n")
            if not buf:
                return False
            self._after_block = False
        at = buf.find(OPEN)
        if at == -1:
            keep = len(buf)
            if not final:  # what may begin a block, and the newlines before it, wait
                keep = len(buf[: keep - _partial_suffix(buf, OPEN)].rstrip("\n"))
            content.append(buf[:keep])
            self._buf = buf[keep:]
            return False
        before = buf[:at].rstrip("\n")
        content.append(before)
        self._newlines = buf[len(before) : at]
        self._buf, self._state = buf[at + len(OPEN) :], "head"
        return True

    def _head(self, buf: str, content: list[str], deltas: list[CallDelta], final: bool) -> bool:
        """Just inside ``<tool_call>``: is the name first? Then the call starts now."""
        close = buf.find(CLOSE)
        got = _header(buf if close == -1 else buf[:close])
        if got is None and close != -1:
            got = False  # the block closed before a name could be read
        if got is None:
            if final:  # an unclosed block is text after all
                content.append(self._newlines + OPEN + buf)
                self._buf, self._state = "", "out"
            return False
        if got is False:
            self._state = "whole"
            return True
        name, end = got
        call = _new_call(name)
        self.calls.append(call)
        deltas.append(CallDelta(len(self.calls) - 1, "", call))
        self._buf, self._state, self._scan = buf[end:], "call", _Scan()
        return True

    def _whole(self, buf: str, content: list[str], deltas: list[CallDelta], final: bool) -> bool:
        """A block read whole once it closes."""
        close = buf.find(CLOSE)
        if close == -1:
            if final:
                content.append(self._newlines + OPEN + buf)
                self._buf, self._state = "", "out"
            return False
        call = _whole_call(buf[:close].strip())
        if call is None:
            content.append(self._newlines + OPEN + buf[: close + len(CLOSE)])
        else:
            self.calls.append(call)
            deltas.append(CallDelta(len(self.calls) - 1, call.arguments, call))
        self._buf, self._state, self._after_block = buf[close + len(CLOSE) :], "out", call is not None
        return True

    def _call(self, buf: str, content: list[str], deltas: list[CallDelta], final: bool) -> bool:
        """A call's object after its name: scan up to the block's end (or all but what may be
        its start), streaming the arguments value's text."""
        close = buf.find(CLOSE)
        end = close if close != -1 else len(buf) - (0 if final else _partial_suffix(buf, CLOSE))
        self._advance(buf[:end])
        scan, index = self._scan, len(self.calls) - 1
        if close != -1 or final:
            if not scan.has_arguments:
                scan.out.append("{}")  # NOTE: a call that names no arguments takes none
            self._buf = buf[close + len(CLOSE) :] if close != -1 else ""
            self._state, self._after_block = "out", True
        else:
            self._buf = buf[end:]
        if scan.out:
            text = "".join(scan.out)
            scan.out.clear()
            self.calls[index].arguments += text
            deltas.append(CallDelta(index, text))
        return self._state == "out"

    def _advance(self, text: str) -> None:
        """Scan ``text`` of the open call's object: keys, values, and the arguments value's text."""
        s = self._scan
        for c in text:
            if s.state == "scalar" and (c in _WS or c in ",}"):
                s.state = "object"  # a number or literal ends at its delimiter, read again below
            if s.state in ("value", "string", "scalar"):
                if s.emitting:
                    s.out.append(c)
                self._value_char(c)
            elif s.state == "key":
                if not s.escaped and c == '"':
                    s.state = "colon"
                else:
                    s.escaped = not s.escaped and c == "\\"
                    s.key += c
            elif c in _WS or s.state == "skip":
                continue
            elif s.state == "object":  # after the name or a value: another key, or the end
                s.state = "key_start" if c == "," else "skip"
            elif s.state == "key_start":
                s.state, s.key, s.escaped = ("key" if c == '"' else "skip"), "", False
            elif s.state == "colon":
                s.state = "value_start" if c == ":" else "skip"
            elif s.state == "value_start":
                s.emitting = _key(s.key) in ARGUMENT_KEYS and not s.has_arguments
                s.has_arguments = s.has_arguments or s.emitting
                if s.emitting:
                    s.out.append(c)
                s.depth, s.in_string, s.escaped = 0, c == '"', False
                s.state = "value" if c in "{[" else "string" if c == '"' else "scalar"
                if c in "{[":
                    s.depth = 1

    def _value_char(self, c: str) -> None:
        """One character inside a value (after its first): where it ends."""
        s = self._scan
        if s.state == "scalar":
            return
        if s.in_string:
            if s.escaped:
                s.escaped = False
            elif c == "\\":
                s.escaped = True
            elif c == '"':
                s.in_string = False
                if s.state == "string":
                    s.state = "object"
        elif c == '"':
            s.in_string = True
        elif c in "{[":
            s.depth += 1
        elif c in "}]":
            s.depth -= 1
            if s.depth == 0:
                s.state = "object"


def _key(raw: str) -> str:
    try:
        return json.loads(f'"{raw}"')
    except json.JSONDecodeError:
        return raw
