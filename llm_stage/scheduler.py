"""Continuous batching with chunked prefill, prefix reuse and preemption.

Each step first serves running sequences (a decode token, or the next chunk
of an unfinished prefill), then admits waiting ones while the token budget,
the sequence cap and the block pool allow. A sequence that cannot get a block
preempts the most recently admitted one, which goes back to the front of the
queue and later resumes (its computed blocks usually still cached).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import Enum, auto

from llm_stage.block_manager import BlockManager, PrefixMatch
from llm_stage.sequence import SeqStatus, Sequence


class _Admit(Enum):
    RUN = auto()
    NO_ROOM = auto()
    PARK = auto()  # needs media rows again before it can resume


@dataclass(frozen=True, slots=True)
class StepOutput:
    seq_id: int
    token_id: int | None
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.starving: list[Sequence] = []  # parked: the service re-fetches their media rows
        self.num_preemptions = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, seq_id: int) -> Sequence | None:
        for queue in (self.waiting, self.starving):
            for seq in queue:
                if seq.seq_id == seq_id:
                    queue.remove(seq)
                    return self._finish(seq, "abort")
        for seq in self.running:
            if seq.seq_id == seq_id:
                return self._finish(seq, "abort")
        return None

    def schedule(self) -> list[tuple[Sequence, int]]:
        """Pick ``(seq, num_tokens)`` to compute this step."""
        budget = self.max_num_batched_tokens
        batch: list[tuple[Sequence, int]] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_uncomputed_tokens, budget)
            if not self._reserve(seq, seq.num_computed_tokens + n, batch):
                continue
            batch.append((seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            verdict = self._admit(seq, budget)
            if verdict is _Admit.NO_ROOM and not self.running and not batch and self._release_waiting_holds():
                verdict = self._admit(seq, budget)
            if verdict is _Admit.NO_ROOM:
                break
            self.waiting.popleft()
            if verdict is _Admit.PARK:
                self.starving.append(seq)
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            self.blocks.grow(seq, seq.num_computed_tokens + n)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            batch.append((seq, n))
            budget -= n
        return batch

    def _admit(self, seq: Sequence, budget: int) -> _Admit:
        """Give ``seq`` its prefix blocks if the pool has room for them and its next chunk."""
        size = self.blocks.block_size
        if seq.block_table:  # the service already holds its cached prefix
            if not self.blocks.can_grow(
                seq, seq.num_computed_tokens + min(seq.num_uncomputed_tokens, budget)
            ):
                return _Admit.NO_ROOM
        else:
            match = self.match(seq)
            if match.num_tokens(size) < seq.rows_floor:
                # Resumed after preemption, but part of the prefix it never fetched rows for is gone.
                return _Admit.PARK
            if not self.blocks.can_allocate(match, min(seq.num_tokens - len(match.blocks) * size, budget)):
                return _Admit.NO_ROOM
            self.blocks.allocate(seq, match)
        if seq.num_preemptions == 0:
            self.blocks.stats.queries += seq.num_prompt_tokens
            self.blocks.stats.hits += seq.num_cached_tokens
        return _Admit.RUN

    def match(self, seq: Sequence) -> PrefixMatch:
        """``seq``'s cached prefix; at least its last token is always computed (its logits give
        the next token)."""
        if not self.blocks.enable_caching:
            return PrefixMatch([])
        hashes = seq.update_block_hashes(self.blocks.block_size)
        return self.blocks.match_prefix(hashes, seq.token_ids, seq.spans, seq.num_tokens - 1)

    def _release_waiting_holds(self) -> bool:
        """Nothing runs and the head cannot start: the prefixes other waiting sequences hold are
        what fills the pool. Let them go (those sequences fetch their rows again when admitted)."""
        released = False
        for seq in list(self.waiting)[1:]:
            if seq.block_table:
                self.blocks.free_seq(seq)
                released = True
        return released

    def _reserve(self, seq: Sequence, num_tokens: int, batch: list[tuple[Sequence, int]]) -> bool:
        """Blocks for ``seq``'s first ``num_tokens``, preempting newer sequences if needed."""
        while not self.blocks.can_grow(seq, num_tokens):
            victim = self.running[-1]
            if any(victim is s for s, _ in batch):
                victim = seq  # never undo work already in this step's batch
            self._preempt(victim)
            if victim is seq:
                return False
        self.blocks.grow(seq, num_tokens)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free_seq(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def postprocess(self, batch: list[tuple[Sequence, int]], tokens: list[int]) -> list[StepOutput]:
        """Advance sequences after a forward; ``tokens`` holds one sample per sequence that reached
        its last token this step, in batch order."""
        outputs: list[StepOutput] = []
        sampled = iter(tokens)
        for seq, n in batch:
            seq.num_computed_tokens += n
            reached_end = seq.num_computed_tokens == seq.num_tokens
            if self.blocks.enable_caching:
                self.blocks.commit(seq, seq.update_block_hashes(self.blocks.block_size))
            if not reached_end:
                continue
            token = next(sampled)
            seq.append_token(token)
            reason = seq.check_finished(token)
            if reason is not None:
                self._finish(seq, reason)
            outputs.append(self.output(seq, token))
        return outputs

    def output(self, seq: Sequence, token: int | None, error: str | None = None) -> StepOutput:
        return StepOutput(
            seq.seq_id, token, seq.finish_reason, seq.num_prompt_tokens, seq.num_cached_tokens, error
        )

    def _finish(self, seq: Sequence, reason: str) -> Sequence:
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        if seq.block_table:  # running, or waiting with a held prefix
            self.blocks.free_seq(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        return seq
