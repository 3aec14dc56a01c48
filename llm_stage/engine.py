"""The generation engine behind the LLM service: requests in, tokens out, one step at a time.

:meth:`Engine.step` runs in one worker thread; the service calls everything
else from the event loop. The loop never touches a sequence the engine owns:
it sends typed commands (:class:`Submit`, :class:`Cancel`, :class:`AddRows`,
:class:`Fail`) through an inbox the step drains first. Probes read the block
pool from the loop, so both sides take :attr:`Engine.lock` around it; the
model forward itself runs unlocked.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from llm_stage.block_manager import BlockManager
from llm_stage.kv_cache import KVCache, kv_budget_bytes
from llm_stage.kv_store import KVStore
from llm_stage.kv_tier import KVTier, KVWanted
from llm_stage.model_runner import ModelRunner
from llm_stage.prompt_logprobs import K_MAX, PromptLogprobStore
from llm_stage.sampler import sample_with_logprobs
from llm_stage.scheduler import RowsWanted, Scheduler, StepOutput
from llm_stage.sequence import MediaRows, SeqStatus, Sequence
from llm_stage.text_model import TextLM
from shared.block_hash import BlockHash
from shared.checkpoint import ModelSpec
from shared.config import LLMConfig
from shared.kv_block_codec import KVLayout, StoredBlock
from shared.messages import MediaSpan
from shared.torch_utils import resolve_device, resolve_dtype

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
class Fail:
    seq: Sequence
    message: str


@dataclass(frozen=True, slots=True)
class AddKV:
    """Blocks of ``seq``'s chain from block ``first`` read from the shared KV tier (maybe none)."""

    seq: Sequence
    first: int
    blocks: list[StoredBlock]


Command = Submit | Cancel | AddRows | Fail | AddKV


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
        self.dtype = resolve_dtype(cfg.dtype, self.device)
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
        self.kv = KVCache(self.lm, num_blocks, cfg.block_size, self.device, self.dtype)
        store = PromptLogprobStore(num_blocks, cfg.block_size, self.device) if with_store else None
        self.runner = ModelRunner(self.lm, self.kv)
        self.blocks = BlockManager(num_blocks, cfg.block_size, cfg.prefix_cache, store)
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.kv_tier = self._kv_tier(cfg) if cfg.kv_tier else None
        self.lock = threading.Lock()
        self._inbox: deque[Command] = deque()
        self._probe_ids = itertools.count(1)
        self._probes: dict[int, tuple[list[int], float]] = {}  # probe id → (held blocks, expiry)
        self.num_steps = 0
        log.info(
            "engine: %s on %s/%s, %d KV blocks of %d tokens, max_model_len %d, prefix cache %s",
            spec.name,
            self.device,
            self.dtype,
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

    # --- called from the event loop ------------------------------------------------

    def probe(
        self,
        hashes: list[BlockHash],
        token_ids: list[int],
        spans: list[MediaSpan],
        ttl: float,
    ) -> tuple[int, int]:
        """Cached prefix length (tokens) of a prompt; pins the matched blocks for ``ttl`` seconds.

        Returns:
            (cached tokens, probe id to pass on so the pin is released early; 0 if nothing pinned)
        """
        with self.lock:
            self._expire_probes()
            # NOTE: at least the last token is always computed: its logits give the next token.
            match = self.blocks.match_prefix(hashes, token_ids, spans, len(token_ids) - 1)
            held = match.held()
            if not held:
                return 0, 0
            self.blocks.hold(held)
            probe_id = next(self._probe_ids)
            self._probes[probe_id] = (held, time.monotonic() + ttl)
        return match.num_tokens(self.blocks.block_size), probe_id

    def release_probe(self, probe_id: int) -> None:
        with self.lock:
            self._release_probe(probe_id)

    def _release_probe(self, probe_id: int) -> None:
        held = self._probes.pop(probe_id, None)
        if held is not None:
            self.blocks.release(held[0])

    def _expire_probes(self) -> None:
        now = time.monotonic()
        for probe_id in [p for p, (_, expiry) in self._probes.items() if expiry <= now]:
            self.blocks.release(self._probes.pop(probe_id)[0])

    def memory_info(self) -> dict[str, int]:
        """Bytes of the prompt logprob store beside the KV pool, and the budget they share."""
        store = self.blocks.logprobs
        return {
            "kv_budget_bytes": self.budget_bytes,
            "prompt_logprob_store_bytes": store.nbytes if store is not None else 0,
            "prompt_logprob_blocks": store.num_carrying if store is not None else 0,
        }

    def submit(self, seq: Sequence) -> None:
        self._inbox.append(Submit(seq))

    def cancel(self, seq: Sequence) -> None:
        self._inbox.append(Cancel(seq))

    def add_rows(self, seq: Sequence, rows: list[MediaRows]) -> None:
        """Hand fetched media rows to ``seq`` (applied by the worker thread before its next step)."""
        self._inbox.append(AddRows(seq, rows))

    def fail(self, seq: Sequence, message: str) -> None:
        """End ``seq`` with an error (its media rows could not be had)."""
        self._inbox.append(Fail(seq, message))

    def add_kv(self, seq: Sequence, first: int, blocks: list[StoredBlock]) -> None:
        """Hand ``seq`` what the KV tier read for it (applied before the next step)."""
        self._inbox.append(AddKV(seq, first, blocks))

    def has_work(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_work()

    @property
    def load(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running) + len(self._inbox)

    # --- called from the worker thread -----------------------------------------------

    def step(self) -> StepResult:
        with self.lock:
            self._expire_probes()
            outputs = [out for cmd in self._drain() if (out := self._apply(cmd)) is not None]
            plan = self.scheduler.schedule()
            for seq in plan.admitted:
                if seq.probe_id:  # the scheduler holds the prefix now: the probe's pin can go
                    self._release_probe(seq.probe_id)
            for copy in plan.copies:
                self.runner.copy_block_start(copy)
                self.blocks.release([copy.source])
        result = StepResult(outputs, plan.fetches, plan.admitted, kv_fetches=plan.kv_fetches)
        if not plan.items:
            return result
        try:
            logits, scored = self.runner.forward(plan.items)
            tokens, logprobs = sample_with_logprobs(logits, plan.sampled)
        except Exception as exc:
            log.exception("engine step failed; failing its %d sequences", len(plan.items))
            with self.lock:
                for item in plan.items:
                    self.scheduler.abort(item.seq, "error")
                    outputs.append(self.scheduler.output(item.seq, None, f"{type(exc).__name__}: {exc}"))
            return result
        self.num_steps += 1
        with self.lock:
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
