"""Tool calling: the request's ``tools`` / ``tool_choice`` (the model's blocks: processor.tool_stream).

Qwen2-VL / Qwen2.5-VL checkpoints whose chat template has a tool format list the tools in the
system turn and answer with blocks ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
the template renders earlier calls and ``tool`` results the same way.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from mmcache.processor.errors import bad_request

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
    out: dict[str, object] = {"name": name}
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
