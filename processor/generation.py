"""One parsed request through the pipeline, for every endpoint built on chat's internals.

Chat completions, Responses, Completions and batch lines all end as a :class:`ChatRequest`
(or a prompt already tokenised); this module prepares it, runs its choices and fills a
:class:`Completion`, so that each endpoint only translates its request and renders its answer.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from mmcache.processor.choices import choices
from mmcache.processor.dispatch import Dispatcher
from mmcache.processor.pipeline import Pipeline, Prepared
from mmcache.processor.request import ChatRequest
from mmcache.processor.responses import Completion
from mmcache.shared.messages import GenerateReply


@dataclass(frozen=True, slots=True)
class Engine:
    """What a request needs to run: the pipeline (media, prompt) and the dispatcher (stages)."""

    pipeline: Pipeline
    dispatcher: Dispatcher
    model: str

    @property
    def tokenizer(self):
        return self.pipeline.prompts.tokenizer

    async def prepare(self, req: ChatRequest, token_ids: list[int] | None = None) -> Prepared:
        """The request prepared: media and chat template, or (``token_ids``) a raw prompt as is."""
        if token_ids is None:
            return await self.pipeline.prepare(req)
        # NOTE: as Pipeline.prepare: --no-cache gives every request a namespace of its own.
        salt = secrets.token_hex(16) if self.pipeline.cfg.no_cache else req.cache_salt
        return Prepared(req, token_ids, [], [], salt)

    def done(self, prepared: Prepared) -> None:
        self.pipeline.done(prepared)

    def generation(self, completion: Completion) -> AsyncGenerator[tuple[int, GenerateReply], None]:
        """(choice index, reply) as they come; closing it aborts what is still generating."""
        return choices(
            self.dispatcher,
            completion.prepared,
            lambda i: completion.choices[i].finish_reason is not None,
        )

    async def run(self, completion: Completion, on_reply: Callable[[], None] | None = None) -> None:
        """Generate every choice to its end (non-streamed)."""
        generation = self.generation(completion)
        async with contextlib.aclosing(generation):
            async for index, chunk in generation:
                completion.choices[index].update(chunk)
                if on_reply is not None:
                    on_reply()
                if completion.done:
                    break  # a stop string ended the last choice: the stage need not go on
