"""One request's state inside the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

import torch

from shared.block_hash import BlockHash, block_hashes
from shared.messages import MediaSpan, SamplingParams


class SeqStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(slots=True)
class MediaRows:
    """Embedding rows that replace the placeholder tokens ``[start, start + len(rows))``."""

    start: int
    rows: torch.Tensor  # (tokens, hidden)

    @property
    def end(self) -> int:
        return self.start + self.rows.shape[0]


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    token_ids: list[int]  # prompt, then generated tokens
    num_prompt_tokens: int
    positions: torch.Tensor  # (3, num_prompt_tokens) M-RoPE positions of the prompt
    rope_delta: int  # a token at index j >= num_prompt_tokens sits at position j + rope_delta
    media: list[MediaRows]
    spans: list[MediaSpan]
    root_hash: BlockHash
    sampling: SamplingParams
    max_model_len: int
    stop_ids: frozenset[int]  # end-of-sequence ids (unless ignore_eos) and the request's stop ids
    status: SeqStatus = SeqStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    num_committed_blocks: int = 0  # leading blocks whose hashes are published
    num_preemptions: int = 0
    rows_floor: int = 0  # media rows are present for every media token at or after this index
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    block_hashes: list[BlockHash] = field(default_factory=list)
    kv_copy: tuple[int, int, int] | None = None  # (source block, own block, tokens) still to copy
    matcher: Any = None  # llguidance matcher of the request's grammar (fed every sampled token)
    token_tensor: torch.Tensor | None = None  # token_ids for the penalties, grown as tokens come

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def positions_for(self, start: int, end: int) -> torch.Tensor:
        """M-RoPE positions (3, end - start) of tokens ``[start, end)``."""
        prompt_end = min(end, self.num_prompt_tokens)
        parts = []
        if start < prompt_end:
            parts.append(self.positions[:, start:prompt_end])
        if end > self.num_prompt_tokens:
            first = max(start, self.num_prompt_tokens)
            text = torch.arange(first, end, dtype=torch.long) + self.rope_delta
            parts.append(text.expand(3, -1))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def update_block_hashes(self, block_size: int) -> list[BlockHash]:
        """Hashes of every full block of the tokens so far (computed incrementally)."""
        if len(self.token_ids) // block_size > len(self.block_hashes):
            self.block_hashes = block_hashes(
                self.token_ids, self.spans, block_size, self.root_hash, known=self.block_hashes
            )
        return self.block_hashes

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def check_finished(self, token_id: int) -> str | None:
        if token_id in self.stop_ids:
            return "stop"
        if self.matcher is not None and self.matcher.is_stopped():
            return "stop"  # the grammar is complete: nothing but the end may follow
        if self.num_output_tokens >= self.sampling.max_tokens or self.num_tokens >= self.max_model_len:
            return "length"
        return None
