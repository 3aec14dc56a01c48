"""The generation engine behind the LLM service: requests in, tokens out, one step at a time.

:meth:`Engine.step` runs in one worker thread; the service calls everything
else from the event loop, and only while no step runs (the loop awaits each
step), so nothing here takes a lock. The loop never touches a sequence the
engine owns: it sends typed commands (:class:`Submit`, :class:`Cancel`,
:class:`AddRows`, :class:`GrammarReady`, :class:`Fail`) through an inbox the step
drains first. Probes read the block pool and pin what they matched; the
scheduler lets each pin go (admission, end, expiry).

A step that fails in the model (forward or sampling) fails the sequences it
computed and leaves the engine consistent; a failure anywhere else is raised:
the service then no longer trusts the engine (see ``LLMService``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from mmcache.llm_stage.attention_select import choose_backend, log_choice, make_backend
from mmcache.llm_stage.block_manager import BlockManager
from mmcache.llm_stage.cuda_graphs import build_graphs
from mmcache.llm_stage.faults import StepFaults
from mmcache.llm_stage.kv_cache import KVCache, kv_budget_bytes
from mmcache.llm_stage.kv_store import KVStore
from mmcache.llm_stage.kv_tier import KVTier, KVWanted
from mmcache.llm_stage.model_runner import ModelRunner
from mmcache.llm_stage.prompt_logprobs import K_MAX, PromptLogprobStore
from mmcache.llm_stage.sampler import sample_with_logprobs
from mmcache.llm_stage.scheduler import RowsWanted, Scheduler, StepOutput
from mmcache.llm_stage.sequence import MediaRows, SeqStatus, Sequence
from mmcache.llm_stage.text_model import TextLM
from mmcache.shared.block_hash import BlockHash
from mmcache.shared.checkpoint import ModelSpec
from mmcache.shared.config import LLMConfig
from mmcache.shared.kv_block_codec import KVLayout, StoredBlock
from mmcache.shared.messages import MediaSpan
from mmcache.shared.torch_utils import resolve_device, resolve_dtype

log = logging.getLogger(__name__)


# --- commands: what the event loop asks of the worker thread, applied at the start of a step ---


@dataclass(frozen=True, slots=True)
class Submit:
    seq: Sequence


@dataclass(frozen=True, slots=True)
class Cancel:
    seq: Sequence


@dataclass(frozen=True, slots=True)
class AddRows:
    seq: Sequence
    rows: list[MediaRows]


@dataclass(frozen=True, slots=True)
class GrammarReady:
    seq: Sequence
    matcher: Any  # llguidance matcher, its state past any resumed tokens


@dataclass(frozen=True, slots=True)
class Fail:
    seq: Sequence
    message: str


@dataclass(frozen=True, slots=True)
class AddKV:
    """Blocks of ``seq``'s chain from block ``first`` read from the shared KV tier (maybe none)."""

    seq: Sequence
    first: int
    blocks: list[StoredBlock]


Command = Submit | Cancel | AddRows | GrammarReady | Fail | AddKV


@dataclass(frozen=True, slots=True)
class StepResult:
    outputs: list[StepOutput]  # tokens and ends, per sequence
    fetches: list[RowsWanted]  # media rows to fetch for sequences that lack them
    admitted: list[Sequence]  # sequences admitted for the first time (their cached prefix is known)
    computed: bool = False  # the step ran the model
    kv_fetches: list[KVWanted] = dataclasses.field(default_factory=list)  # reads of the KV tier


class Engine:
    def __init__(self, cfg: LLMConfig, spec: ModelSpec):
        self.spec = spec
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device, spec.saved_dtype)
        self.lm = TextLM(spec, self.device, self.dtype)
        per_block = KVCache.bytes_per_block(self.lm, cfg.block_size, self.dtype)
        # NOTE: the prompt logprob store sits beside the KV blocks (one row of slots per block) and
        # is paid from the same budget; without the prefix cache nothing is reused, so no store.
        with_store = cfg.prefix_cache and not cfg.no_prompt_logprob_store
        store_per_block = PromptLogprobStore.bytes_per_block(cfg.block_size) if with_store else 0
        self.budget_bytes = kv_budget_bytes(cfg.kv_cache_gb, self.device)
        num_blocks = cfg.num_kv_blocks or self.budget_bytes // (per_block + store_per_block)
        wanted_len = cfg.max_model_len or spec.max_position_embeddings
        self.max_model_len = min(wanted_len, num_blocks * cfg.block_size)
        if self.max_model_len < wanted_len:
            log.warning("KV pool holds %d blocks: max_model_len capped to %d", num_blocks, self.max_model_len)
        choice = choose_backend(cfg.attention_backend, self.device, self.dtype, self.lm.head_dim)
        # NOTE: with CUDA graphs possible, the pool holds one spare block past those the block manager
        # hands out: the padding rows of a captured decode batch write there and nowhere else.
        graphs = choice.name == "flashinfer" and cfg.cuda_graph_max_batch > 0
        pad_block = num_blocks if graphs else None
        self.kv = KVCache(self.lm, num_blocks + int(graphs), cfg.block_size, self.device, self.dtype)
        store = PromptLogprobStore(num_blocks, cfg.block_size, self.device) if with_store else None
        max_pages = -(-self.max_model_len // cfg.block_size)
        attention, choice = make_backend(choice, self.kv, self.lm.num_heads, self.lm.scaling, max_pages)
        log_choice(choice)
        self.attention_backend = choice.name
        self.runner = ModelRunner(self.lm, self.kv, attention)
        self.graphs = build_graphs(
            self.runner, attention, cfg.cuda_graph_max_batch, cfg.max_num_seqs, pad_block
        )
        self.blocks = BlockManager(num_blocks, cfg.block_size, cfg.prefix_cache, store)
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.kv_tier = self._kv_tier(cfg) if cfg.kv_tier else None
        # NOTE: appended by the event loop, drained by the worker thread: deque's append and
        # popleft are atomic, the only state both sides touch while a step runs.
        self._inbox: deque[Command] = deque()
        self.faults = StepFaults()  # armed by tests only
        self.num_steps = 0
        self.num_step_failures = 0  # steps whose model call raised (their sequences failed)
        log.info(
            "engine: %s on %s/%s, attention %s, cuda graphs %s, %d KV blocks of %d tokens, "
            "max_model_len %d, prefix cache %s",
            spec.name,
            self.device,
            self.dtype,
            self.attention_backend,
            "on" if self.graphs is not None else "off",
            num_blocks,
            cfg.block_size,
            self.max_model_len,
            "on" if cfg.prefix_cache else "off",
        )

    def _kv_tier(self, cfg: LLMConfig) -> KVTier:
        """The shared KV tier, hooked into the block manager (writes) and the scheduler (reads)."""
        layout = KVLayout(
            self.spec.weights_fingerprint,
            self.dtype,
            cfg.block_size,
            len(self.lm.layers),
            self.lm.num_kv_heads,
            self.lm.head_dim,
            1 + K_MAX,
        )
        tier = KVTier(KVStore(cfg.kv_store, cfg.kv_store_timeout), layout, cfg.kv_store_queue)
        self.blocks.on_publish = lambda block: tier.offer(self.kv, self.blocks, block)
        self.scheduler.kv_wanted = lambda seq: tier.wanted(self.blocks, seq)
        return tier

    # --- called from the event loop, between steps ---------------------------------

    def probe(
        self,
        hashes: list[BlockHash],
        token_ids: list[int],
        spans: list[MediaSpan],
        ttl: float,
    ) -> tuple[int, int]:
        """Cached prefix length (tokens) of a prompt; pins the matched blocks for ``ttl`` seconds.

        Returns:
            (cached tokens, pin id to pass on so the pin is let go early; 0 if nothing pinned)
        """
        self.scheduler.expire(time.monotonic())
        # NOTE: at least the last token is always computed: its logits give the next token.
        match = self.blocks.match_prefix(hashes, token_ids, spans, len(token_ids) - 1)
        held = match.held()
        if not held:
            return 0, 0
        pin_id = self.blocks.pin(held, time.monotonic() + ttl)
        return match.num_tokens(self.blocks.block_size), pin_id

    def release_pin(self, pin_id: int) -> None:
        """A probe's pin whose request will not come (refused, or routed elsewhere)."""
        self.blocks.unpin(pin_id)

    def next_deadline(self) -> float | None:
        """When (``time.monotonic()``) a step has something to do without news: a pin expires."""
        return self.scheduler.next_deadline()

    def memory_info(self) -> dict[str, int]:
        """Bytes of the prompt logprob store beside the KV pool, and the budget they share."""
        store = self.blocks.logprobs
        return {
            "kv_budget_bytes": self.budget_bytes,
            "prompt_logprob_store_bytes": store.nbytes if store is not None else 0,
            "prompt_logprob_blocks": store.num_carrying if store is not None else 0,
        }

    # --- commands: may be sent while a step runs (applied at the start of the next) -------

    def submit(self, seq: Sequence) -> None:
        self._inbox.append(Submit(seq))

    def cancel(self, seq: Sequence) -> None:
        self._inbox.append(Cancel(seq))

    def add_rows(self, seq: Sequence, rows: list[MediaRows]) -> None:
        """Hand fetched media rows to ``seq``."""
        self._inbox.append(AddRows(seq, rows))

    def grammar_ready(self, seq: Sequence, matcher: Any) -> None:
        """``seq``'s grammar compiled: it may be scheduled."""
        self._inbox.append(GrammarReady(seq, matcher))

    def fail(self, seq: Sequence, message: str) -> None:
        """End ``seq`` with an error (its media rows or its grammar could not be had)."""
        self._inbox.append(Fail(seq, message))

    def add_kv(self, seq: Sequence, first: int, blocks: list[StoredBlock]) -> None:
        """Hand ``seq`` what the KV tier read for it (applied before the next step)."""
        self._inbox.append(AddKV(seq, first, blocks))

    def has_work(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_work()

    @property
    def load(self) -> int:
        return self.scheduler.num_unfinished + len(self._inbox)

    # --- called from the worker thread -----------------------------------------------

    def step(self) -> StepResult:
        self.scheduler.expire(time.monotonic())
        outputs = [out for cmd in self._drain() if (out := self._apply(cmd)) is not None]
        self.faults.check("schedule")
        plan = self.scheduler.schedule()
        for copy in plan.copies:
            self.runner.copy_block_start(copy)
            self.blocks.release([copy.source])
        result = StepResult(outputs, plan.fetches, plan.admitted, kv_fetches=plan.kv_fetches)
        if not plan.items:
            return result
        try:
            self.faults.check("compute")
            logits = self.graphs.run(plan.items) if self.graphs is not None else None
            if logits is None:
                logits, scored = self.runner.forward(plan.items)
            else:  # a decode-only step: nothing to score
                scored = []
            tokens, logprobs = sample_with_logprobs(logits, plan.sampled)
        except Exception as exc:
            # NOTE: nothing of the plan was applied yet: ending its sequences leaves the engine
            # as consistent as a cancel does.
            log.exception("engine step failed; failing its %d sequences", len(plan.items))
            self.num_step_failures += 1
            for item in plan.items:
                self.scheduler.abort(item.seq, "error")
                outputs.append(self.scheduler.output(item.seq, None, f"{type(exc).__name__}: {exc}"))
            return result
        self.num_steps += 1
        outputs += self.scheduler.postprocess(plan, tokens, logprobs, scored)
        return dataclasses.replace(result, computed=True)

    def _drain(self) -> list[Command]:
        out = []
        while self._inbox:
            out.append(self._inbox.popleft())
        return out

    def _apply(self, cmd: Command) -> StepOutput | None:
        """Carry out one command from the event loop; returns the output it ends a sequence with."""
        seq = cmd.seq
        if isinstance(cmd, Submit):
            self.scheduler.add(seq)
        elif isinstance(cmd, AddRows):
            if seq.status is not SeqStatus.FINISHED:
                seq.media.extend(cmd.rows)
                self.scheduler.rows_arrived(seq)
        elif isinstance(cmd, GrammarReady):
            self.scheduler.grammar_ready(seq, cmd.matcher)
        elif isinstance(cmd, AddKV):
            if self.kv_tier is not None and seq.status is SeqStatus.WAITING_FOR_KV:
                self.kv_tier.adopt(self.kv, self.blocks, seq, cmd.first, cmd.blocks)
            self.scheduler.kv_arrived(seq)
        elif isinstance(cmd, Cancel):
            if self.scheduler.abort(seq):
                return self.scheduler.output(seq, None)
        elif self.scheduler.abort(seq, "error"):  # Fail
            return self.scheduler.output(seq, None, cmd.message)
        return None
