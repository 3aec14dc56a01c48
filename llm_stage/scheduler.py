"""Continuous batching: prefill in parts (vLLM's chunked prefill), prefix reuse, media rows as a
resource, and preemption.

Each step first serves running sequences (a decode token, or the next part
of an unfinished prefill), then admits waiting ones while the token budget,
the sequence cap and the block pool allow. Admission matches and allocates the
cached prefix here, so nothing holds blocks for a sequence the scheduler has
not admitted.

Media rows (the embeddings that replace a prompt's placeholder tokens) are
scheduled like blocks: a step covers only the tokens whose rows are present.
A sequence whose rows are missing gets them asked for in the step's plan
(:attr:`StepPlan.fetches`) and, once it cannot go further without them, waits
in ``WAITING_FOR_MEDIA`` until they arrive. The first fetch after a prefix hit
and the fetch after a preemption that lost part of the prefix are the same:
whatever rows the next tokens need and the sequence lacks.

A sequence whose grammar is still compiling is ``WAITING_FOR_GRAMMAR``: held
aside, out of the queue, until :meth:`Scheduler.grammar_ready` queues it. The
scheduler also owns every probe's pin on a prefix (kept in the block manager): let
go when its sequence is admitted or ends, or at its expiry (:meth:`next_deadline`
tells the engine loop when to wake for that).

A sequence that cannot get a block preempts the most recently admitted one,
which goes back to the front of the queue and later resumes (its computed
blocks usually still cached, its media rows kept).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from mmcache.llm_stage import prompt_logprob_blocks
from mmcache.llm_stage.block_manager import BlockCopy, BlockManager, PrefixMatch
from mmcache.llm_stage.kv_tier import KVWanted
from mmcache.llm_stage.prompt_logprobs import Scored
from mmcache.llm_stage.sequence import SeqStatus, Sequence
from mmcache.shared.messages import TokenLogprobs


@dataclass(frozen=True, slots=True)
class StepOutput:
    seq_id: int
    token_id: int | None
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None
    logprobs: TokenLogprobs | None = None  # of ``token_id``, when the request asks
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with the first token, when asked


@dataclass(frozen=True, slots=True)
class StepItem:
    """Tokens ``[start, end)`` of ``seq`` computed this step."""

    seq: Sequence
    start: int
    end: int
    # NOTE: the one place the rule is written: an item reaching the sequence's last token gives
    # logits (its next token is sampled); every other item only fills the KV cache.
    samples: bool

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class RowsWanted:
    """Media rows ``seq`` lacks for its prompt tokens in ``ranges``: the service fetches them."""

    seq: Sequence
    ranges: list[tuple[int, int]]


@dataclass(slots=True)
class StepPlan:
    """What one step does, for the model runner and the service to carry out."""

    items: list[StepItem] = field(default_factory=list)
    copies: list[BlockCopy] = field(default_factory=list)  # shared block starts, run before the forward
    fetches: list[RowsWanted] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # first admissions (their prefix is known)
    kv_fetches: list[KVWanted] = field(default_factory=list)  # prefixes to read from the KV tier

    @property
    def sampled(self) -> list[Sequence]:
        """The sequences whose next token this step samples, in item order."""
        return [item.seq for item in self.items if item.samples]


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admitted: RUNNING or WAITING_FOR_MEDIA
        self.compiling: dict[int, Sequence] = {}  # WAITING_FOR_GRAMMAR, by seq id
        self.num_preemptions = 0
        # KV tier hook: the blocks of a sequence's chain to read from the shared store before it is
        # admitted (None: nothing to read); its sequences wait in ``kv_waiting`` meanwhile.
        self.kv_wanted: Callable[[Sequence], KVWanted | None] | None = None
        self.kv_waiting: list[Sequence] = []

    def has_work(self) -> bool:
        """Sequences a step could advance (not those waiting for their grammar or the KV tier)."""
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.compiling) + len(self.kv_waiting)

    def add(self, seq: Sequence) -> None:
        if seq.status is SeqStatus.WAITING_FOR_GRAMMAR:
            self.compiling[seq.seq_id] = seq
        else:
            self.waiting.append(seq)

    def grammar_ready(self, seq: Sequence, matcher: Any) -> None:
        """``seq``'s grammar compiled: it takes its place in the queue (unless it ended meanwhile)."""
        if self.compiling.pop(seq.seq_id, None) is not None:
            seq.matcher = matcher
            seq.status = SeqStatus.WAITING
            self.waiting.append(seq)

    def abort(self, seq: Sequence, reason: str = "abort") -> bool:
        """End ``seq`` wherever it is; False if it had already finished."""
        if seq.status is SeqStatus.FINISHED:
            return False
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SeqStatus.WAITING_FOR_KV:
            self.kv_waiting.remove(seq)
        self._finish(seq, reason)
        return True

    def next_deadline(self) -> float | None:
        """When (``time.monotonic()``) the next pin expires, if any: the engine loop's timeout."""
        return self.blocks.next_pin_expiry()

    def expire(self, now: float) -> None:
        self.blocks.expire_pins(now)

    def rows_arrived(self, seq: Sequence) -> None:
        """``seq``'s fetch has added its rows: it may go on (a preempted one waits its turn)."""
        seq.rows_pending = False
        if seq.status is SeqStatus.WAITING_FOR_MEDIA:
            seq.status = SeqStatus.RUNNING

    def kv_arrived(self, seq: Sequence) -> None:
        """The KV tier's read for ``seq`` is done (its blocks, if any, are in the pool): it goes back
        to the front of the queue, where it was."""
        if seq.status is SeqStatus.WAITING_FOR_KV:
            self.kv_waiting.remove(seq)
            seq.status = SeqStatus.WAITING
            self.waiting.appendleft(seq)

    def _ask_kv_tier(self, seq: Sequence, plan: StepPlan) -> bool:
        """KV tier hook: park ``seq`` while the store is read for its prefix (once per sequence)."""
        if self.kv_wanted is None or seq.kv_asked:
            return False
        seq.kv_asked = True
        wanted = self.kv_wanted(seq)
        if wanted is None:
            return False
        self.waiting.popleft()
        seq.status = SeqStatus.WAITING_FOR_KV
        self.kv_waiting.append(seq)
        plan.kv_fetches.append(wanted)
        return True

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # waiting for its rows, or preempted earlier in this loop
            n = self._step_tokens(seq, budget, plan)
            if n == 0 or not self._reserve(seq, seq.num_computed_tokens + n, plan):
                continue
            plan.items.append(self._item(seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self._ask_kv_tier(seq, plan):
                continue
            if not self._admit(seq, budget, plan):
                break
            self.waiting.popleft()
            self.running.append(seq)
            n = self._step_tokens(seq, budget, plan)
            if n:
                self.blocks.grow(seq, seq.num_computed_tokens + n)
                plan.items.append(self._item(seq, n))
                budget -= n
        return plan

    def _item(self, seq: Sequence, n: int) -> StepItem:
        start = seq.num_computed_tokens
        return StepItem(seq, start, start + n, start + n == seq.num_tokens)

    def _step_tokens(self, seq: Sequence, budget: int, plan: StepPlan) -> int:
        """Tokens of ``seq`` to compute this step: within the budget, and only as far as its media
        rows are present. Missing rows are asked for once; with none to compute, it waits."""
        ready = seq.num_tokens
        if seq.num_computed_tokens < seq.num_prompt_tokens:  # generated tokens need no rows
            missing = seq.missing_rows(seq.num_computed_tokens)
            if missing:
                ready = missing[0][0]
                if not seq.rows_pending:
                    seq.rows_pending = True
                    plan.fetches.append(RowsWanted(seq, missing))
        n = min(seq.num_uncomputed_tokens, budget, ready - seq.num_computed_tokens)
        seq.status = SeqStatus.RUNNING if n else SeqStatus.WAITING_FOR_MEDIA
        return n

    def _admit(self, seq: Sequence, budget: int, plan: StepPlan) -> bool:
        """Give ``seq`` its cached prefix if the pool has room for it and its first step's tokens."""
        match = self.match(seq)
        if not self._fits(seq, match, budget):
            if match.partial is None:
                return False
            # NOTE: a shared start saves compute, not room. Prompt logprobs need the start (the
            # last cached token is computed again), so such a request starts from nothing.
            match = PrefixMatch([] if seq.wants_prompt_logprobs else match.blocks)
            if not self._fits(seq, match, budget):
                return False
        copy = self.blocks.allocate(seq, match)
        if copy is not None:
            plan.copies.append(copy)
        if seq.wants_prompt_logprobs:
            prompt_logprob_blocks.start(seq, self.blocks, match)
        seq.status = SeqStatus.RUNNING
        self._unpin(seq)  # NOTE: after allocate: the sequence holds the prefix now
        if seq.num_preemptions == 0:
            self.blocks.stats.queries += seq.num_prompt_tokens
            self.blocks.stats.hits += seq.num_cached_tokens
            plan.admitted.append(seq)
        return True

    def _fits(self, seq: Sequence, match: PrefixMatch, budget: int) -> bool:
        """Room for ``match`` and the first step's tokens after it."""
        first_step = min(seq.num_tokens - match.num_tokens(self.blocks.block_size), budget)
        return self.blocks.can_allocate(match, first_step)

    def match(self, seq: Sequence) -> PrefixMatch:
        """``seq``'s cached prefix; at least its last token is always computed (its logits give
        the next token)."""
        if not self.blocks.enable_caching:
            return PrefixMatch([])
        hashes = seq.update_block_hashes(self.blocks.block_size)
        if not seq.wants_prompt_logprobs:
            return self.blocks.match_prefix(hashes, seq.token_ids, seq.spans, seq.num_tokens - 1)
        return prompt_logprob_blocks.match_with_logprobs(self.blocks, seq, hashes)

    def _reserve(self, seq: Sequence, num_tokens: int, plan: StepPlan) -> bool:
        """Blocks for ``seq``'s first ``num_tokens``, preempting newer sequences if needed."""
        while not self.blocks.can_grow(seq, num_tokens):
            victim = self.running[-1]
            if any(victim is item.seq for item in plan.items):
                victim = seq  # never undo work already in this step's plan
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

    def postprocess(
        self,
        plan: StepPlan,
        tokens: list[int],
        logprobs: list[TokenLogprobs | None] | None = None,
        scored: Iterable[Scored] = (),
    ) -> list[StepOutput]:
        """Advance sequences after a forward; ``tokens`` (and ``logprobs``) hold one sample per
        sampling item, in plan order; ``scored`` the prompt logprobs computed."""
        for s in scored:
            if s.seq.plp_ids is not None and s.seq.plp_values is not None:
                s.seq.plp_ids[s.start : s.start + len(s.ids)] = s.ids
                s.seq.plp_values[s.start : s.start + len(s.ids)] = s.values
        outputs: list[StepOutput] = []
        sampled = iter(tokens)
        token_lps = iter(logprobs if logprobs is not None else [None] * len(tokens))
        for item in plan.items:
            seq = item.seq
            seq.num_computed_tokens = item.end
            if self.blocks.enable_caching:
                if seq.wants_prompt_logprobs:
                    prompt_logprob_blocks.store(seq, self.blocks)
                self.blocks.commit(seq, seq.update_block_hashes(self.blocks.block_size))
            if not item.samples:
                continue
            token, lp = next(sampled), next(token_lps)
            prompt = prompt_logprob_blocks.take(seq) if seq.wants_prompt_logprobs else None
            seq.append_token(token)
            reason = seq.check_finished(token)
            if reason is not None:
                self._finish(seq, reason)
            outputs.append(dataclasses.replace(self.output(seq, token, logprobs=lp), prompt_logprobs=prompt))
        return outputs

    def output(
        self,
        seq: Sequence,
        token: int | None,
        error: str | None = None,
        logprobs: TokenLogprobs | None = None,
    ) -> StepOutput:
        return StepOutput(
            seq.seq_id,
            token,
            seq.finish_reason,
            seq.num_prompt_tokens,
            seq.num_cached_tokens,
            error,
            logprobs,
        )

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status in (SeqStatus.RUNNING, SeqStatus.WAITING_FOR_MEDIA):
            self.running.remove(seq)
            self.blocks.free_seq(seq)
        elif seq.status is SeqStatus.WAITING_FOR_GRAMMAR:
            del self.compiling[seq.seq_id]
        self._unpin(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def _unpin(self, seq: Sequence) -> None:
        if seq.pin_id:
            self.blocks.unpin(seq.pin_id)
            seq.pin_id = 0
