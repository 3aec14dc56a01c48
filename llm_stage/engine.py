"""The generation engine behind the LLM service: requests in, tokens out, one step at a time.

The service calls :meth:`Engine.submit` and :meth:`Engine.cancel` from the event
loop and :meth:`Engine.step` from one worker thread; the two meet only in the
thread-safe inbox, drained at the start of each step.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from llm_stage.block_manager import BlockManager
from llm_stage.model_runner import KVCache, ModelRunner
from llm_stage.sampler import sample
from llm_stage.scheduler import Scheduler, StepOutput
from llm_stage.sequence import Sequence
from llm_stage.text_model import TextLM
from shared.checkpoint import ModelSpec
from shared.config import LLMConfig
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
        self.max_model_len = min(
            cfg.max_model_len or spec.max_position_embeddings, num_blocks * cfg.block_size
        )
        if self.max_model_len < (cfg.max_model_len or spec.max_position_embeddings):
            log.warning("KV pool holds %d blocks: max_model_len capped to %d", num_blocks, self.max_model_len)
        self.kv = KVCache(self.lm, num_blocks, cfg.block_size, self.device, self.dtype)
        self.runner = ModelRunner(self.lm, self.kv)
        self.blocks = BlockManager(num_blocks, cfg.block_size, cfg.prefix_cache)
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self._inbox: deque[Callable[[], StepOutput | None]] = deque()
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

    def submit(self, seq: Sequence) -> None:
        self._inbox.append(lambda: self.scheduler.add(seq))

    def cancel(self, seq_id: int) -> None:
        def abort() -> StepOutput | None:
            seq = self.scheduler.abort(seq_id)
            return None if seq is None else self.scheduler.output(seq, None)

        self._inbox.append(abort)

    def has_work(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_work()

    @property
    def load(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running) + len(self._inbox)

    # --- called from the worker thread -----------------------------------------------

    def step(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        while self._inbox:
            out = self._inbox.popleft()()
            if out is not None:
                outputs.append(out)
        batch = self.scheduler.schedule()
        if not batch:
            return outputs
        try:
            logits = self.runner.run(batch)
            ready = [seq for seq, n in batch if seq.num_computed_tokens + n == seq.num_tokens]
            tokens = sample(logits, ready)
        except Exception:
            log.exception("engine step failed; failing its %d sequences", len(batch))
            for seq, _ in batch:
                self.scheduler.abort(seq.seq_id)
                seq.finish_reason = "error"
                outputs.append(self.scheduler.output(seq, None))
            return outputs
        self.num_steps += 1
        return outputs + self.scheduler.postprocess(batch, tokens)
