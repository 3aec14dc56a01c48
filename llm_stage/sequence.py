"""One request's state inside the engine."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

import torch

from mmcache.llm_stage.positions import mrope_positions
from mmcache.shared.block_hash import BlockHash, block_hashes
from mmcache.shared.messages import MediaSpan, SamplingParams


class SeqStatus(Enum):
    WAITING_FOR_GRAMMAR = auto()  # its grammar is being compiled: not in the queue yet, holds no blocks
    WAITING = auto()  # in the queue: holds no blocks
    RUNNING = auto()  # admitted: holds its blocks, computed each step
    WAITING_FOR_MEDIA = auto()  # admitted, but its next token needs media rows still being fetched
    WAITING_FOR_KV = auto()  # not admitted: the shared KV tier is being read for its prefix
    FINISHED = auto()


@dataclass(slots=True)
class MediaRows:
    """Embedding rows that replace the placeholder tokens ``[start, start + len(rows))``.

    Feature set 0 replaces the tokens' embeddings; set ``1 + i`` (deepstack) is added to their
    hidden states after decoder layer ``i``.
    """

    start: int
    rows: torch.Tensor  # (tokens, feature sets, hidden)

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
    rows_pending: bool = False  # a fetch of its missing media rows is under way
    pin_id: int = 0  # its probe's pin on its prefix (BlockManager.pins): let go at admission or end
    kv_asked: bool = False  # the shared KV tier was asked for its prefix (once per sequence)
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    block_hashes: list[BlockHash] = field(default_factory=list)
    matcher: Any = None  # llguidance matcher of the request's grammar (fed every sampled token)
    token_tensor: torch.Tensor | None = None  # token_ids for the penalties, grown as tokens come
    # Prompt logprobs (asked for, not sent yet): one row per prompt token, see llm_stage.prompt_logprobs.
    plp_ids: torch.Tensor | None = None
    plp_values: torch.Tensor | None = None
    plp_from: int = 1  # the first token whose entry this sequence computes (earlier ones: the store)
    plp_sent: bool = False

    @classmethod
    def new(
        cls,
        seq_id: int,
        prompt: list[int] | torch.Tensor,
        spans: list[MediaSpan],
        root_hash: BlockHash,
        sampling: SamplingParams,
        max_model_len: int,
        eos_token_ids: Iterable[int],
        tokens_per_second: float,
        block_size: int = 0,
        pin_id: int = 0,
        media: list[MediaRows] | None = None,
    ) -> Sequence:
        """A new request's sequence: M-RoPE positions, stop ids and (``block_size`` > 0, the prefix
        cache on) the prompt's block hashes, computed once here."""
        token_ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
        positions, delta = mrope_positions(len(token_ids), spans, tokens_per_second)
        stop = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(eos_token_ids))
        return cls(
            seq_id=seq_id,
            token_ids=token_ids,
            num_prompt_tokens=len(token_ids),
            positions=positions,
            rope_delta=delta,
            media=list(media or []),
            spans=spans,
            root_hash=root_hash,
            sampling=sampling,
            max_model_len=max_model_len,
            stop_ids=frozenset(stop),
            pin_id=pin_id,
            # NOTE: later blocks (generated tokens) are hashed incrementally.
            block_hashes=block_hashes(prompt, spans, block_size, root_hash) if block_size else [],
        )

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling.prompt_logprobs is not None and not self.plp_sent

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def missing_rows(self, start: int) -> list[tuple[int, int]]:
        """Ranges of prompt media tokens at or after ``start`` whose rows are not present."""
        out: list[tuple[int, int]] = []
        for lo, hi in media_ranges(self.spans):
            pos = max(lo, start)
            while pos < hi:
                covered = _covered_until(self.media, pos)
                if covered == pos:  # nothing at ``pos``: missing up to the next rows that start
                    covered = min((r.start for r in self.media if pos < r.start < hi), default=hi)
                    out.append((pos, covered))
                pos = covered
        return out

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


def media_ranges(spans: list[MediaSpan]) -> list[tuple[int, int]]:
    """The placeholder token ranges of the prompt's media items, in prompt order."""
    return sorted((span.offset, span.offset + span.num_tokens) for span in spans)


def _covered_until(media: list[MediaRows], at: int) -> int:
    """How far present rows reach contiguously from token ``at`` (``at`` itself if no row covers it)."""
    end = at
    grew = True
    while grew:
        grew = False
        for rows in media:
            if rows.start <= end < rows.end:
                end, grew = rows.end, True
    return end
