"""A generate request while the LLM stage serves it: its sequence, its caller and its media state,
and the replies its caller is sent."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from mmcache.llm_stage.media_fetch import ChunkRef
from mmcache.llm_stage.scheduler import StepOutput
from mmcache.llm_stage.sequence import Sequence
from mmcache.shared.keys import ChunkKey
from mmcache.shared.messages import ErrorReply, GenerateReply, Reencoded, TokenLogprobs
from mmcache.shared.rpc import Responder

# NOTE: a request nobody reads token by token still reports its tokens every so often, so that if
# this replica dies the processor moves it with its tokens so far instead of starting it again.
PROGRESS_EVERY = 16


@dataclass(slots=True, eq=False)
class LiveRequest:
    """A generate request the stage is serving."""

    seq: Sequence
    reply: Responder
    refs: list[ChunkRef]
    pinned: set[ChunkKey]  # chunks this request holds a hand-off pin for at their encoders
    queue: asyncio.Queue[StepOutput] = field(default_factory=asyncio.Queue)
    tasks: set[asyncio.Task] = field(default_factory=set)
    repairs: int = 0
    reencoded: asyncio.Future[Reencoded] | None = None  # while the processor re-encodes for it
    failure: ErrorReply | None = None  # why it ended with an error, when that was not the engine


async def send_replies(live: LiveRequest, stream: bool) -> ErrorReply | None:
    """Send ``live``'s outputs to its caller until it ends: when ``stream``, one reply with what came
    since the last one, else one every :data:`PROGRESS_EVERY` tokens and one at the end. If it
    failed, the error to end it with (the caller sends it)."""
    tokens: list[int] = []
    logprobs: list[TokenLogprobs] = []
    prompt: list[TokenLogprobs | None] | None = None
    while True:
        outs = [await live.queue.get()]
        while not live.queue.empty():
            outs.append(live.queue.get_nowait())
        last = outs[-1]
        if last.finish_reason == "error":
            return live.failure or ErrorReply("engine_error", last.error or "generation failed", 500)
        tokens += [o.token_id for o in outs if o.token_id is not None]
        logprobs += [o.logprobs for o in outs if o.logprobs is not None]
        prompt = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), prompt)
        if not stream and last.finish_reason is None and len(tokens) < PROGRESS_EVERY:
            continue  # a message per PROGRESS_EVERY tokens instead of one per step
        out = GenerateReply(
            tokens, last.finish_reason, last.num_prompt_tokens, last.num_cached_tokens, logprobs, prompt
        )
        await live.reply.send(out, final=last.finish_reason is not None)
        if last.finish_reason is not None:
            return None
        tokens, logprobs, prompt = [], [], None
