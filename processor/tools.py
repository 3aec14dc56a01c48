"""Tool calling: the request's ``tools`` / ``tool_choice`` and the model's ``<tool_call>`` blocks.

Qwen2-VL / Qwen2.5-VL checkpoints whose chat template has a tool format list the tools in the
system turn and answer with blocks ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
the template renders earlier calls and ``tool`` results the same way.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from processor.errors import bad_request

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True, slots=True)
class Tools:
    functions: list[dict]  # {"name", "description"?, "parameters"?}: what the template lists
    choice: str  # "none" | "auto" | "required" | "function"
    forced: str | None = None  # the function a named tool_choice asks for
    parallel: bool = True

    @property
    def constrained(self) -> list[dict]:
        """The functions the answer must call (empty: the model may answer in text)."""
        if self.choice == "required":
            return self.functions
        if self.choice == "function":
            return [f for f in self.functions if f["name"] == self.forced]
        return []


def parse_tools(body: dict) -> Tools | None:
    raw = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_request(
            "'parallel_tool_calls' must be a boolean", "invalid_parallel_tool_calls", "parallel_tool_calls"
        )
    if raw is None:
        if choice not in (None, "none"):
            raise bad_request("'tool_choice' needs 'tools'", "invalid_tool_choice", "tool_choice")
        return None
    if not isinstance(raw, list) or not raw:
        raise bad_request("'tools' must be a non-empty list", "invalid_tools", "tools")
    functions = [_function(tool, f"tools[{i}]") for i, tool in enumerate(raw)]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise bad_request("tool names must be unique", "invalid_tools", "tools")
    if choice is None or choice in ("none", "auto", "required"):
        return Tools(functions, choice or "auto", None, parallel)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise bad_request(
            '\'tool_choice\' must be none, auto, required or {"type": "function", "function": {"name": ...}}',
            "invalid_tool_choice",
            "tool_choice",
        )
    if name not in names:
        raise bad_request(
            f"tool_choice names {name!r}, which is not in 'tools'", "invalid_tool_choice", "tool_choice"
        )
    return Tools(functions, "function", name, parallel)


def _function(tool: Any, where: str) -> dict:
    if (
        not isinstance(tool, dict)
        or tool.get("type") != "function"
        or not isinstance(tool.get("function"), dict)
    ):
        raise bad_request(
            f'{where} must be {{"type": "function", "function": {{...}}}}', "invalid_tools", where
        )
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request(f"{where}.function.name must match [A-Za-z0-9_-]{{1,64}}", "invalid_tools", where)
    out = {"name": name}
    if fn.get("description") is not None:
        if not isinstance(fn["description"], str):
            raise bad_request(f"{where}.function.description must be a string", "invalid_tools", where)
        out["description"] = fn["description"]
    params = fn.get("parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise bad_request(
                f"{where}.function.parameters must be a JSON schema object", "invalid_tools", where
            )
        out["parameters"] = params
    return out


def template_tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's ``tool_calls`` in the form chat templates render (arguments as objects)."""
    if not isinstance(calls, list):
        raise bad_request(f"{where}.tool_calls must be a list", "invalid_message", where)
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{where}.tool_calls[{i}] needs function.name", "invalid_message", where)
        args = fn.get("arguments", "{}")
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError as exc:
            raise bad_request(
                f"{where}.tool_calls[{i}].function.arguments is not JSON ({exc.msg})",
                "invalid_message",
                where,
            ) from exc
        out.append({"type": "function", "function": {"name": fn["name"], "arguments": parsed}})
    return out


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_dict(self, index: int | None = None) -> dict:
        out: dict = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out["index"] = index
        return out


def split_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """The text outside ``<tool_call>`` blocks and the calls the blocks hold (a block that is not a
    call object stays in the text)."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    cursor = 0
    for block in _BLOCK.finditer(text):
        call = _call(block.group(1))
        if call is None:
            continue
        kept.append(text[cursor : block.start()])
        cursor = block.end()
        calls.append(call)
    kept.append(text[cursor:])
    return "".join(kept).strip() if calls else text, calls


def _call(payload: str) -> ToolCall | None:
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall("call_" + uuid.uuid4().hex[:24], obj["name"], json.dumps(args, ensure_ascii=False))


class ToolStream:
    """Streamed text split into content deltas and whole tool calls as their blocks close.

    Text that could still be the start of ``<tool_call>`` is held back, so no part of a block
    ever leaves as content.
    """

    def __init__(self) -> None:
        self._buf = ""
        self.calls: list[ToolCall] = []

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self._buf += text
        content, calls = [], []
        while True:
            at = self._buf.find(OPEN)
            if at == -1:
                keep = 0 if final else _partial_suffix(self._buf, OPEN)
                content.append(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                break
            end = self._buf.find(CLOSE, at)
            if end == -1:
                content.append(self._buf[:at])
                self._buf = self._buf[at:]
                if final:  # an unclosed block is text after all
                    content.append(self._buf)
                    self._buf = ""
                break
            call = _call(self._buf[at + len(OPEN) : end].strip())
            block_end = end + len(CLOSE)
            if call is None:
                content.append(self._buf[:block_end])
                self._buf = self._buf[block_end:]
            else:
                content.append(self._buf[:at].rstrip("\n"))  # the newlines around blocks are not content
                calls.append(call)
                self._buf = self._buf[block_end:].lstrip("\n")
        self.calls += calls
        return "".join(content), calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
