"""Typed messages between the stages (versioned by ``wire.PROTOCOL_VERSION``).

One section per link: processor→encoder, processor→llm, and the control
messages every stage answers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shared.wire import message

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
    info: dict = field(default_factory=dict)
    id: str = ""  # the replica's own stable id (shared.service.replica_id): routing keys on it


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

    key: bytes  # chunk_key
    modality: str  # "image" | "video"
    pixels: torch.Tensor


@message
@dataclass(frozen=True, slots=True)
class LookupRequest:
    """Which of these chunk keys does the encoder lack?

    With ``handoff`` the keys it has are pinned until the request's LLM stage fetches them.
    """

    keys: list[bytes]
    handoff: bool = True


@message
@dataclass(frozen=True, slots=True)
class LookupReply:
    missing: list[bytes]


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
    num_encoded: int  # chunks this request's forwards computed
    num_reused: int  # chunks already cached or computed by a concurrent request


@message
@dataclass(frozen=True, slots=True)
class FetchRequest:
    """Embedding rows ``[start, end)`` of one chunk (LLM stage → encoder)."""

    key: bytes  # chunk_key
    start: int
    end: int
    release: bool = False  # drop this request's hand-off pin after the read


@message
@dataclass(frozen=True, slots=True)
class FetchReply:
    rows: torch.Tensor  # (end - start, hidden)


@message
@dataclass(frozen=True, slots=True)
class ReleaseHandoff:
    """The LLM stage will not fetch these chunks after all (its cached prefix covers them)."""

    keys: list[bytes]


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
    chunk_keys: list[bytes]
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
    block_hashes: list[bytes] = field(default_factory=list)


@message
@dataclass(frozen=True, slots=True)
class ProbeReply:
    cached_tokens: int
    probe_id: int  # 0 when nothing is pinned
    load: int  # sequences waiting or running
    max_model_len: int


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
    stream: bool = True  # False: one reply with every token at the end (nobody reads them earlier)


@message
@dataclass(frozen=True, slots=True)
class GenerateChunk:
    """Streamed reply: new tokens; the last one carries ``finish_reason``."""

    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


@message
@dataclass(frozen=True, slots=True)
class NeedEncode:
    """Final reply instead of tokens: these chunks vanished from their encoders; encode and retry."""

    keys: list[bytes]


@message
@dataclass(frozen=True, slots=True)
class Abort:
    """Stop a running generation (client went away, stop string matched)."""

    request_id: int
