"""Validate response bodies against OpenAI's published schemas (copied into tests/fixtures)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import jsonschema
from referencing import Registry, Resource

FIXTURE = Path(__file__).parent / "fixtures" / "openai_schemas.json"


def _nullable(node):
    """OpenAPI 3.0's ``nullable: true`` (still in the 3.1 document) read as "or null"."""
    if isinstance(node, dict):
        node = {k: _nullable(v) for k, v in node.items()}
        if node.pop("nullable", False):
            node = {"anyOf": [node, {"type": "null"}]}
        return node
    if isinstance(node, list):
        return [_nullable(x) for x in node]
    return node


@cache
def _registry() -> Registry:
    doc = _nullable(json.loads(FIXTURE.read_text()))
    return Registry().with_resource("spec", Resource.opaque(doc))


def validate(instance: object, name: str) -> None:
    """Raise ``jsonschema.ValidationError`` unless ``instance`` is a valid ``name``."""
    validator = jsonschema.Draft202012Validator(
        {"$ref": f"spec#/components/schemas/{name}"}, registry=_registry()
    )
    validator.validate(instance)


def validate_stream(chunks: list[dict], include_usage: bool) -> None:
    """Every chunk a valid ``CreateChatCompletionStreamResponse``, and ``usage`` as the schema's
    description of it says (the copy drops descriptions): with ``stream_options.include_usage``
    every chunk carries it, null except in the last, which has no choices; without, none does."""
    for chunk in chunks:
        validate(chunk, "CreateChatCompletionStreamResponse")
    if not include_usage:
        assert all("usage" not in chunk for chunk in chunks)
        return
    *body, last = chunks
    assert all("usage" in chunk and chunk["usage"] is None for chunk in body)
    assert last["choices"] == [] and last["usage"] is not None
