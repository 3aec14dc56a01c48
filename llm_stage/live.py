"""A generate request while the LLM stage serves it: its sequence, its caller and its media state."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from llm_stage.media_fetch import ChunkRef
from llm_stage.scheduler import StepOutput
from llm_stage.sequence import Sequence
from shared.messages import ErrorReply, Reencoded
from shared.rpc import Responder


@dataclass(slots=True, eq=False)
class LiveRequest:
    """A generate request the stage is serving."""

    seq: Sequence
    reply: Responder
    refs: list[ChunkRef]
    pinned: set[bytes]  # chunks this request holds a hand-off pin for at their encoders
    queue: asyncio.Queue[StepOutput] = field(default_factory=asyncio.Queue)
    tasks: set[asyncio.Task] = field(default_factory=set)
    repairs: int = 0
    reencoded: asyncio.Future[Reencoded] | None = None  # while the processor re-encodes for it
    failure: ErrorReply | None = None  # why it ended with an error, when that was not the engine
