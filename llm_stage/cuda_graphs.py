"""Decode steps replayed from CUDA graphs: one launch per step instead of a few hundred.

A decode-only step (every item one generated token) of ``n`` sequences runs the graph
captured for the smallest size ``>= n`` (:func:`capture_sizes`, :func:`bucket`); the rows
past ``n`` are dummies that read and write one slot of a block no sequence owns (the
engine keeps one spare block at the end of the pool for them) and whose logits are dropped.
Token ids, rotary tables and the attention backend's metadata live in fixed buffers that
are refilled before each replay. Every other step (prefills, prompt logprobs, batches past
the largest size) runs eagerly.

The bucketing and eligibility rules are pure functions; capture and replay need a backend whose
plan lives in fixed buffers (``graphable``: FlashInfer). Off CUDA (tests only: the engine builds
graphs on CUDA alone) a "graph" reruns the captured call on the same buffers, so the buffer and
padding logic is tested on CPU too.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from mmcache.llm_stage.model_runner import ModelRunner, fold_sin
from mmcache.llm_stage.paged_layout import PagedLayout, paged_layout
from mmcache.llm_stage.scheduler import StepItem

log = logging.getLogger(__name__)

SMALL_SIZES = (1, 2, 4)  # below 8, powers of two; from 8 on, every multiple of 8
SIZE_STEP = 8


def capture_sizes(max_batch: int, max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes to capture: 1, 2, 4, then multiples of 8, up to and including
    ``min(max_batch, max_num_seqs)`` (empty when that is 0: no graphs)."""
    top = min(max_batch, max_num_seqs)
    if top <= 0:
        return ()
    sizes = [s for s in SMALL_SIZES if s <= top] + list(range(SIZE_STEP, top + 1, SIZE_STEP))
    if sizes[-1] != top:
        sizes.append(top)
    return tuple(sizes)


def bucket(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds ``n`` rows; None when none does (``sizes`` ascending)."""
    if n <= 0:
        return None
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def is_decode_only(items: list[StepItem]) -> bool:
    """Every item computes one generated token and samples: no media rows, no prompt logprobs."""
    return bool(items) and all(
        it.num_tokens == 1 and it.samples and it.start >= it.seq.num_prompt_tokens for it in items
    )


class GraphableBackend(Protocol):
    graphable: bool

    def graph_plan(self, batch: int) -> Any: ...

    def update_graph_plan(self, plan: Any, layout: PagedLayout) -> None: ...


class _EagerReplay:
    """A CUDA graph's contract without one: each replay reruns the call on the same input buffers
    and writes the same output buffer."""

    def __init__(self, call: Callable[[], torch.Tensor]):
        self.call = call
        self.out = call()

    def replay(self) -> None:
        self.out.copy_(self.call())


@dataclass(frozen=True, slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph | _EagerReplay
    ids: torch.Tensor  # (batch,) token ids
    cos: torch.Tensor  # (batch, 1, head_dim)
    sin: torch.Tensor  # (batch, 1, head_dim), folded (model_runner.fold_sin)
    plan: Any  # the backend's plan over fixed buffers
    logits: torch.Tensor  # (batch, vocab) float32, written by each replay


class DecodeGraphs:
    def __init__(
        self, runner: ModelRunner, backend: GraphableBackend, sizes: tuple[int, ...], pad_block: int
    ):
        self.runner = runner
        self.backend = backend
        self.sizes = sizes
        self.pad_block = pad_block
        self.block_size = runner.kv.block_size
        self.device = runner.device
        self.graphs: dict[int, _Graph] = {}
        self.replays = 0

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every size, largest first (smaller ones reuse its memory pool); returns seconds."""
        began = time.monotonic()
        cuda = self.device.type == "cuda"
        pool = torch.cuda.graph_pool_handle() if cuda else None
        for batch in sorted(self.sizes, reverse=True):
            self.graphs[batch] = self._capture(batch, pool)
        if cuda:
            torch.cuda.synchronize(self.device)
        return time.monotonic() - began

    def _rope(self, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        lm = self.runner.lm
        pos = torch.tensor(positions, device=self.device).expand(3, -1)
        like = torch.empty((len(positions), 1), dtype=lm.lm_head.weight.dtype, device=self.device)
        cos, sin = lm.rope(like, pos)
        return cos[0, :, None], fold_sin(sin)[0, :, None]

    def _capture(self, batch: int, pool: Any) -> _Graph:
        ids = torch.zeros(batch, dtype=torch.long, device=self.device)
        cos, sin = (t.clone() for t in self._rope([0] * batch))
        plan = self.backend.graph_plan(batch)
        empty = PagedLayout([0], [0], [], [], [])
        self.backend.update_graph_plan(plan, empty.padded(batch, self.pad_block, self.block_size))
        if self.device.type != "cuda":
            replay = _EagerReplay(lambda: self.runner.decode_logits(ids, (cos, sin), plan))
            return _Graph(replay, ids, cos, sin, plan, replay.out)
        # NOTE: warm up on a side stream first (library handles, workspaces and lazy kernels are
        # set up outside the capture, as CUDA graphs require).
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.runner.decode_logits(ids, (cos, sin), plan)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self.runner.decode_logits(ids, (cos, sin), plan)
        return _Graph(graph, ids, cos, sin, plan, logits)

    @torch.inference_mode()
    def run(self, items: list[StepItem]) -> torch.Tensor | None:
        """Logits of a decode-only step from its graph, or None when the step is not one of those.

        NOTE: the returned rows are a view of the graph's output buffer: the next replay overwrites
        them, so the caller samples before the next step (the engine does).
        """
        if not is_decode_only(items):
            return None
        batch = bucket(len(items), self.sizes)
        if batch is None:
            return None
        g = self.graphs[batch]
        n = len(items)
        layout = paged_layout(items, self.block_size).padded(batch, self.pad_block, self.block_size)
        self.backend.update_graph_plan(g.plan, layout)
        ids = [it.seq.token_ids[it.start] for it in items] + [0] * (batch - n)
        g.ids.copy_(torch.tensor(ids))
        cos, sin = self._rope([it.start + it.seq.rope_delta for it in items] + [0] * (batch - n))
        g.cos.copy_(cos)
        g.sin.copy_(sin)
        g.graph.replay()
        self.replays += 1
        return g.logits[:n]


def build_graphs(
    runner: ModelRunner, backend: Any, max_batch: int, max_num_seqs: int, pad_block: int | None
) -> DecodeGraphs | None:
    """Capture decode graphs when the device, the backend and the flags allow; else None, logged."""
    sizes = capture_sizes(max_batch, max_num_seqs)
    if not sizes:
        log.info("cuda graphs: off (--cuda-graph-max-batch 0)")
        return None
    if runner.device.type != "cuda":
        log.info("cuda graphs: off (device %s)", runner.device)
        return None
    if not getattr(backend, "graphable", False) or pad_block is None:
        log.info("cuda graphs: off (the %s attention backend is not capturable)", type(backend).__name__)
        return None
    graphs = DecodeGraphs(runner, backend, sizes, pad_block)
    try:
        seconds = graphs.capture()
    except Exception:  # a capture the model or library cannot do: decode eagerly instead
        log.exception("cuda graphs: capture failed; decoding eagerly")
        return None
    log.info("cuda graphs: captured decode batch sizes %s in %.1f s", list(sizes), seconds)
    return graphs
