"""Grammars for constrained decoding: ``response_format`` and forced tool calls.

The processor turns what the client asked for into an llguidance grammar (a string the LLM stage
compiles against its tokenizer) and checks it here, so a bad schema is a 400 before any stage works.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import llguidance

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of its stubs only

from mmcache.processor.errors import bad_request

# NOTE: compact JSON (", " and ": " and no other whitespace): free whitespace is valid JSON, but a
# small or random model then spends its tokens on it.
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
MAX_PARALLEL_CALLS = 8  # most tool calls one constrained answer may hold


def response_format_grammar(value: Any) -> str | None:
    """The grammar of ``response_format`` (None: free text)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request("'response_format' must be an object", "invalid_response_format", "response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return checked(llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_OPTIONS))
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise bad_request(
                "response_format.json_schema must be an object with a 'name'",
                "invalid_response_format",
                "response_format",
            )
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise bad_request(
                "response_format.json_schema.schema must be a JSON schema object",
                "invalid_response_format",
                "response_format",
            )
        return checked(_schema_grammar(schema), "response_format")
    raise bad_request(
        f"response_format.type {kind!r} is not one of text, json_object, json_schema",
        "invalid_response_format",
        "response_format",
    )


def tool_call_grammar(functions: list[dict], parallel: bool) -> str:
    """Qwen's tool-call blocks, each ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
    whose arguments follow the function's parameter schema."""
    rules = []
    for i, fn in enumerate(functions):
        schema = {
            "type": "object",
            "properties": {
                "name": {"const": fn["name"]},
                "arguments": fn.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
            "x-guidance": JSON_OPTIONS,
        }
        rules.append(f"fn{i}: %json {json.dumps(schema)}")
    more = f' ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
    lark = "\n".join(
        [
            f"start: call{more}",
            'call: "<tool_call>\\n" ('
            + " | ".join(f"fn{i}" for i in range(len(functions)))
            + ') "\\n</tool_call>"',
            *rules,
        ]
    )
    return checked(llguidance.LLMatcher.grammar_from_lark(lark), "tools")


def _schema_grammar(schema: dict) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, JSON_OPTIONS)
    except ValueError as exc:
        raise bad_request(f"response_format schema: {exc}", "invalid_json_schema", "response_format") from exc


def checked(grammar: str, param: str = "response_format") -> str:
    error = _validate(grammar)
    if error:
        raise bad_request(f"{param}: the schema cannot be enforced: {error}", "invalid_json_schema", param)
    return grammar


@lru_cache(maxsize=256)
def _validate(grammar: str) -> str:
    """llguidance's verdict on a grammar ('' when it is valid); clients resend the same schemas."""
    return llguidance.LLMatcher.validate_grammar(grammar)
