"""The generation engine behind the LLM service: requests in, tokens out, one step at a time.

:meth:`Engine.step` runs in one worker thread; the service calls everything
else from the event loop. Block-pool state is shared, so both sides take
:attr:`Engine.lock` around it; the model forward itself runs unlocked.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from llm_stage.block_manager import BlockManager
from llm_stage.model_runner import KVCache, ModelRunner
from llm_stage.sampler import sample
from llm_stage.scheduler import Scheduler, StepOutput
from llm_stage.sequence import Sequence
from llm_stage.text_model import TextLM
from shared.block_hash import BlockHash
from shared.checkpoint import ModelSpec
from shared.config import LLMConfig
from shared.messages import MediaSpan
from shared.torch_utils import resolve_device, resolve_dtype

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, cfg: LLMConfig, spec: ModelSpec):
        self.spec = spec
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.lm = TextLM(spec, self.device, self.dtype)
        per_block = KVCache.bytes_per_block(self.lm, cfg.block_size, self.dtype)
        num_blocks = cfg.num_kv_blocks or int(cfg.kv_cache_gb * (1 << 30)) // per_block
        wanted_len = cfg.max_model_len or spec.max_position_embeddings
        self.max_model_len = min(wanted_len, num_blocks * cfg.block_size)
        if self.max_model_len < wanted_len:
            log.warning("KV pool holds %d blocks: max_model_len capped to %d", num_blocks, self.max_model_len)
        self.kv = KVCache(self.lm, num_blocks, cfg.block_size, self.device, self.dtype)
        self.runner = ModelRunner(self.lm, self.kv)
        self.blocks = BlockManager(num_blocks, cfg.block_size, cfg.prefix_cache)
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.lock = threading.Lock()
        self._inbox: deque[Callable[[], StepOutput | None]] = deque()
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
            held = self._probes.pop(probe_id, None)
            if held is not None:
                self.blocks.release(held[0])

    def _expire_probes(self) -> None:
        now = time.monotonic()
        for probe_id in [p for p, (_, expiry) in self._probes.items() if expiry <= now]:
            self.blocks.release(self._probes.pop(probe_id)[0])

    def hold_prefix(self, seq: Sequence) -> int:
        """Attach the cached prefix to ``seq`` before its media rows are fetched; returns its length."""
        if not self.blocks.enable_caching:
            return 0
        with self.lock:
            self.blocks.allocate(seq, self.scheduler.match(seq))
        return seq.num_computed_tokens

    def drop(self, seq: Sequence) -> None:
        """Release a sequence that was never submitted."""
        with self.lock:
            self.blocks.free_seq(seq)

    def submit(self, seq: Sequence) -> None:
        self._inbox.append(lambda: self.scheduler.add(seq))

    def cancel(self, seq_id: int) -> None:
        def abort() -> StepOutput | None:
            seq = self.scheduler.abort(seq_id)
            return None if seq is None else self.scheduler.output(seq, None)

        self._inbox.append(abort)

    def fail(self, seq: Sequence, message: str) -> None:
        """End a sequence that is in no queue (parked) with an error."""

        def fail() -> StepOutput:
            seq.finish_reason = "error"
            return self.scheduler.output(seq, None, message)

        self._inbox.append(fail)

    def take_starving(self) -> list[Sequence]:
        """Sequences parked because their media rows must be fetched again."""
        with self.lock:
            out, self.scheduler.starving = self.scheduler.starving, []
        return out

    def has_work(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_work()

    @property
    def load(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running) + len(self._inbox)

    # --- called from the worker thread -----------------------------------------------

    def step(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        with self.lock:
            self._expire_probes()
            while self._inbox:
                out = self._inbox.popleft()()
                if out is not None:
                    outputs.append(out)
            batch = self.scheduler.schedule()
            for seq, _ in batch:
                if seq.kv_copy is not None:
                    self.runner.copy_block_start(*seq.kv_copy)
                    self.blocks.copied(seq)
        if not batch:
            return outputs
        try:
            logits = self.runner.run(batch)
            ready = [seq for seq, n in batch if seq.num_computed_tokens + n == seq.num_tokens]
            tokens = sample(logits, ready)
        except Exception as exc:
            log.exception("engine step failed; failing its %d sequences", len(batch))
            with self.lock:
                for seq, _ in batch:
                    self.scheduler.abort(seq.seq_id)
                    seq.finish_reason = "error"
                    outputs.append(self.scheduler.output(seq, None, f"{type(exc).__name__}: {exc}"))
            return outputs
        self.num_steps += 1
        with self.lock:
            return outputs + self.scheduler.postprocess(batch, tokens)
