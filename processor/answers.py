"""Whole (non-streamed) answers of the generating endpoints, for callers without an HTTP request:
batch lines. Each runs as its endpoint's handler does, on the same pipeline."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mmcache.processor.completions import CompletionsAnswer, parse_completions
from mmcache.processor.errors import APIError, bad_request
from mmcache.processor.generation import Engine
from mmcache.processor.request import parse_chat_request
from mmcache.processor.response_store import ResponseStore
from mmcache.processor.responses import Completion
from mmcache.processor.responses_api import parse_responses
from mmcache.processor.responses_render import ResponseRender

Answer = Callable[[Any, Mapping[str, memoryview]], Awaitable[dict]]


@dataclass(frozen=True, slots=True)
class Answers:
    engine: Engine
    store: ResponseStore

    def by_path(self) -> dict[str, Answer]:
        return {
            "/v1/chat/completions": self.chat,
            "/v1/completions": self.completions,
            "/v1/responses": self.responses,
        }

    def _model(self, name: Any) -> None:
        if name != self.engine.model:
            raise APIError(
                404,
                f"model {name!r} does not exist; this server serves {self.engine.model!r}",
                "model_not_found",
                "model",
            )

    async def chat(self, body: Any, held: Mapping[str, memoryview]) -> dict:
        req = parse_chat_request(body, held)
        self._model(req.model)
        if req.stream:
            raise bad_request("a batch line cannot be streamed", "invalid_stream", "stream")
        prepared = await self.engine.prepare(req)
        try:
            completion = Completion(self.engine.model, req, prepared, self.engine.tokenizer)
            await self.engine.run(completion)
            return completion.body()
        finally:
            self.engine.done(prepared)

    async def completions(self, body: Any, held: Mapping[str, memoryview]) -> dict:
        req = parse_completions(body, self.engine.tokenizer)
        self._model(body.get("model"))
        if req.chat.stream:
            raise bad_request("a batch line cannot be streamed", "invalid_stream", "stream")
        return await CompletionsAnswer(self.engine, req).run()

    async def responses(self, body: Any, held: Mapping[str, memoryview]) -> dict:
        req = parse_responses(body, held, self.store)
        self._model(req.chat.model)
        if req.chat.stream:
            raise bad_request("a batch line cannot be streamed", "invalid_stream", "stream")
        prepared = await self.engine.prepare(req.chat)
        try:
            completion = Completion(self.engine.model, req.chat, prepared, self.engine.tokenizer)
            await self.engine.run(completion)
            return ResponseRender(req, completion, self.engine.model).final(self.store)
        finally:
            self.engine.done(prepared)
