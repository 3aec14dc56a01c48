"""vLLM's ``POST /tokenize`` and ``POST /detokenize``.

``/tokenize`` takes a ``prompt`` (text as is) or chat ``messages``; messages go through the same
preparation as a chat request (chat template, media fetched and laid out), so ``count`` includes
each image's and video's tokens, exactly the prompt the model would see.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mmcache.processor.errors import bad_request
from mmcache.processor.generation import Engine
from mmcache.processor.request import parse_chat_request

MAX_DETOKENIZE = 1 << 20  # most token ids one /detokenize takes


async def tokenize(engine: Engine, body: Any, held: Mapping[str, memoryview], max_model_len: int) -> dict:
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return_strs = body.get("return_token_strs", False)
    if not isinstance(return_strs, bool):
        raise bad_request(
            "'return_token_strs' must be a boolean", "invalid_return_token_strs", "return_token_strs"
        )
    if "prompt" in body and "messages" in body:
        raise bad_request("give 'prompt' or 'messages', not both", "invalid_request", "prompt")
    if "messages" in body:
        if body.get("add_generation_prompt", True) is not True:
            raise bad_request(
                "'add_generation_prompt': false is not supported",
                "unsupported_parameter",
                "add_generation_prompt",
            )
        keep = ("model", "messages", "tools", "tool_choice", "cache_salt")
        req = parse_chat_request({k: body[k] for k in keep if k in body}, held)
        prepared = await engine.prepare(req)
        engine.done(prepared)
        ids = prepared.token_ids
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad_request("'prompt' (a string) or 'messages' is required", "invalid_prompt", "prompt")
        special = body.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise bad_request(
                "'add_special_tokens' must be a boolean", "invalid_add_special_tokens", "add_special_tokens"
            )
        ids = engine.tokenizer.encode(prompt, add_special_tokens=special)
    return {
        "count": len(ids),
        "max_model_len": max_model_len,
        "tokens": ids,
        "token_strs": engine.tokenizer.convert_ids_to_tokens(ids) if return_strs else None,
    }


def detokenize(engine: Engine, body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    ids = body.get("tokens")
    vocab = len(engine.tokenizer)
    if (
        not isinstance(ids, list)
        or len(ids) > MAX_DETOKENIZE
        or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids)
    ):
        raise bad_request(
            f"'tokens' must be a list of at most {MAX_DETOKENIZE} token ids in [0, {vocab})",
            "invalid_tokens",
            "tokens",
        )
    return {"prompt": engine.tokenizer.decode(ids)}
