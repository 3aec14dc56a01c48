"""OpenAI chat-completion response shapes and their SSE framing."""

from __future__ import annotations

import time
import uuid

import orjson
from aiohttp import web

from processor.pipeline import Prepared
from processor.request import ChatRequest

SSE_DONE = b"data: [DONE]\n\n"


async def sse(resp: web.StreamResponse, payload: dict) -> None:
    await resp.write(b"data: " + orjson.dumps(payload) + b"\n\n")


class Completion:
    """Accumulates one completion's state and renders OpenAI response shapes."""

    def __init__(self, model: str, req: ChatRequest, prepared: Prepared):
        self.id = "chatcmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.req = req
        self.prepared = prepared
        self.num_prompt_tokens = len(prepared.token_ids)
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self.finish_reason: str | None = None

    def update(self, chunk) -> None:
        self.num_output_tokens += len(chunk.token_ids)
        self.num_cached_tokens = chunk.num_cached_tokens
        if chunk.finish_reason is not None:
            self.finish_reason = "length" if chunk.finish_reason == "length" else "stop"

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_output_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens},
            "mm_cache": self.prepared.report.as_dict(),
        }

    def body(self, text: str, token_ids: list[int]) -> dict:
        choice: dict = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": self.finish_reason or "stop",
            "logprobs": None,
        }
        out = {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(),
        }
        if self.req.return_token_ids:
            choice["token_ids"] = token_ids
            out["prompt_token_ids"] = self.prepared.token_ids
        return out

    def chunk(self, delta: dict, finish: bool = False) -> dict:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "delta": delta,
                    "finish_reason": (self.finish_reason or "stop") if finish else None,
                    "logprobs": None,
                }
            ],
        }

    def usage_chunk(self) -> dict:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": self.usage(),
        }
