"""Typed messages between the stages (versioned by ``wire.PROTOCOL_VERSION``).

One section per link: processor→encoder, processor→llm, and the control
messages every stage answers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mmcache.shared.keys import BlockHash, ChunkKey
from mmcache.shared.wire import message

# --- control (every stage) ---------------------------------------------------


@message
@dataclass(frozen=True, slots=True)
class Ping:
    pass


@message
@dataclass(frozen=True, slots=True)
class Pong:
    stage: str
    model: str
    fingerprint: bytes
    load: int = 0  # requests queued or running
    info: dict = field(default_factory=dict)  # counters, for people (metrics), never for routing
    block_size: int = 0  # an LLM replica's KV block size (routing hashes blocks of this size)
    id: str = ""  # the replica's own stable id (shared.service.replica_id): routing keys on it
    max_model_len: int = 0  # an LLM replica's context length (0: not told)
    # NOTE: False from a replica that answers but can no longer serve (its engine failed):
    # discovery drops it as if it did not answer, and it refuses requests.
    healthy: bool = True


@message
@dataclass(frozen=True, slots=True)
class ErrorReply:
    """A request failed; ``code`` is machine readable, ``status`` the HTTP status to surface."""

    code: str
    message: str
    status: int = 500


# --- processor → encoder -----------------------------------------------------


@message
@dataclass(frozen=True, slots=True)
class EncodeItem:
    """One chunk of pixels: an image (1 frame) or one temporal patch of a video.

    ``pixels`` are resized uint8, shaped (frames, channels, height, width); the
    encoder normalises and patchifies them.
    """

    key: ChunkKey
    modality: str  # "image" | "video"
    pixels: torch.Tensor


@message
@dataclass(frozen=True, slots=True)
class LookupRequest:
    """Which of these chunk keys does the encoder lack?

    With ``handoff`` the keys it has are pinned until the request's LLM stage fetches them.
    """

    keys: list[ChunkKey]
    handoff: bool = True


@message
@dataclass(frozen=True, slots=True)
class LookupReply:
    missing: list[ChunkKey]


@message
@dataclass(frozen=True, slots=True)
class EncodeRequest:
    """Compute and keep the embeddings of these chunks.

    With ``handoff`` each entry stays pinned until one fetch with ``release``
    (or a timeout): the request's LLM stage is about to pull it.
    """

    items: list[EncodeItem]
    handoff: bool = True


@message
@dataclass(frozen=True, slots=True)
class EncodeReply:
    """Every item of the request is cached at the encoder (and pinned for hand-off if asked)."""


@message
@dataclass(frozen=True, slots=True)
class FetchRequest:
    """Embedding rows ``[start, end)`` of one chunk (LLM stage → encoder)."""

    key: ChunkKey
    start: int
    end: int
    release: bool = False  # drop this request's hand-off pin after the read


@message
@dataclass(frozen=True, slots=True)
class FetchReply:
    rows: torch.Tensor  # (end - start, feature sets, hidden)


@message
@dataclass(frozen=True, slots=True)
class ReleaseHandoff:
    """The LLM stage will not fetch these chunks after all (its cached prefix covers them)."""

    keys: list[ChunkKey]


# --- processor → llm ---------------------------------------------------------


@message
@dataclass(frozen=True, slots=True)
class MediaSpan:
    """Where one image or video sits in the prompt.

    The item's placeholder tokens are ``[offset, offset + num_tokens)``; chunk ``i``
    covers ``tokens_per_chunk`` of them starting at ``offset + i * tokens_per_chunk``.
    """

    offset: int
    modality: str  # "image" | "video"
    grid_thw: tuple[int, int, int]  # in patches, before the spatial merge
    chunk_keys: list[ChunkKey]
    seconds_per_chunk: float = 1.0  # temporal_patch_size / sampling fps (video only)
    merge_size: int = 2

    @property
    def num_tokens(self) -> int:
        return len(self.chunk_keys) * self.tokens_per_chunk

    @property
    def tokens_per_chunk(self) -> int:
        return self.grid_thw[1] * self.grid_thw[2] // (self.merge_size * self.merge_size)


@message
@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Logits processing, all off by default (a request that leaves them off pays nothing).
    presence_penalty: float = 0.0  # OpenAI's: minus this for every token already generated
    frequency_penalty: float = 0.0  # OpenAI's: minus this times the token's count in the output
    repetition_penalty: float = 1.0  # HF's: prompt and output tokens' logits divided (or times) by it
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id → added to its logit
    min_tokens: int = 0  # stop tokens are banned until this many tokens are generated
    grammar: str | None = None  # llguidance grammar the output must follow
    logprobs: int | None = None  # None: none; k: each output token's logprob and the top k
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's logprob and the top k

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Does anything change the logits before sampling (the grammar is tracked on its own)?"""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )


@message
@dataclass(frozen=True, slots=True)
class ProbeRequest:
    """How much of this prompt does the replica have cached? Pins the matched blocks for ``ttl``."""

    prompt_token_ids: torch.Tensor  # int32
    spans: list[MediaSpan]
    salt: str | None = None
    ttl: float = 10.0
    # The prompt's block hashes, computed once by the processor for every replica it probes;
    # a replica with another block size (or when absent) computes its own.
    block_size: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)


@message
@dataclass(frozen=True, slots=True)
class ProbeReply:
    cached_tokens: int
    probe_id: int  # 0 when nothing is pinned
    load: int  # sequences waiting or running
    max_model_len: int
    # the prefix (tokens) the replica's pool and the shared KV store hold together (0: no more than
    # cached_tokens); a hint: the blocks are read, and checked, only when the request comes
    stored_tokens: int = 0


@message
@dataclass(frozen=True, slots=True)
class ReleaseProbe:
    probe_id: int


@message
@dataclass(frozen=True, slots=True)
class GenerateRequest:
    prompt_token_ids: torch.Tensor  # int32, (num_tokens,)
    spans: list[MediaSpan]
    sources: list[str]  # encoder address per chunk (spans in order, chunks in order)
    handoff: list[bool]  # per chunk: this request holds a hand-off pin at that encoder
    sampling: SamplingParams
    salt: str | None = None
    probe_id: int = 0  # pin from an earlier ProbeRequest, released once the prefix is held
    stream: bool = True  # False: nobody reads tokens as they come: one reply per 16 or so, not per step
    # A generation moved here from a replica that died: the tokens it had generated already
    # (this replica continues after them and sends only what comes next).
    resume_token_ids: list[int] = field(default_factory=list)


@message
@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One position's log-probabilities: of the token there, and the top ones (most likely first)."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]
    rank: int = 0  # 1 + how many tokens are more likely than the token there (0: not computed)


@message
@dataclass(frozen=True, slots=True)
class GenerateReply:
    """Streamed reply: new tokens; the last one carries ``finish_reason``."""

    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token, when asked
    # Asked for: in the first reply, one per prompt token (None for the first: nothing precedes it).
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@message
@dataclass(frozen=True, slots=True)
class NeedEncode:
    """Mid-stream (not final): the rows of these chunks could not be read at their encoders
    (evicted, never encoded because a cached prefix covered them, encoder gone). The request
    stays alive: encode them again and answer with :class:`Reencoded`."""

    keys: list[ChunkKey]
    cause: str = "missing"  # "missing" | "unreachable"


@message
@dataclass(frozen=True, slots=True)
class Reencoded:
    """Processor → LLM stage, for a live generate request: the chunks of its :class:`NeedEncode`
    are at their encoders again (and pinned for this request)."""

    request_id: int  # the generate request's id on this connection
    keys: list[ChunkKey]
    sources: list[str]  # encoder address per chunk, as in GenerateRequest (owners may have moved)


@message
@dataclass(frozen=True, slots=True)
class Abort:
    """Stop a running generation (client went away, stop string matched)."""

    request_id: int
