"""Attention over the paged KV cache, behind a small backend seam.

The model runner computes q, k and v for every row of a step and hands them to
an :class:`AttentionBackend`: the backend plans once per step how attention
reads the cache (the same for every layer), writes the step's K/V into their
slots, and attends. :class:`SdpaBackend` is the CPU backend (and the GPU fallback):
on a CPU with the compiled kernels (:mod:`mmcache.shared.cpu_kernels`), one C call
a layer for a prefill chunk (reading the blocks through the sequence's table:
nothing gathered, no mask built) and one for the step's single-token decodes;
elsewhere PyTorch's scaled-dot-product attention over K/V gathered from the blocks
for prefill chunks, and two float32 matrix products around a softmax for decodes
(torch's fused CPU kernel spends ~0.5 ms a layer on one query over 512 keys, the
two products ~0.1 ms). A paged GPU kernel reading block tables directly is a new
class with the same three methods (:mod:`llm_stage.attention_flashinfer`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from mmcache.llm_stage.kv_cache import KVCache
from mmcache.llm_stage.scheduler import StepItem
from mmcache.shared import cpu_kernels


class AttentionBackend(Protocol):
    # NOTE: a plan is the backend's own record: the runner only hands it back (Any, not object,
    # so each backend may type its own).
    def plan(self, items: list[StepItem]) -> Any:
        """Per-step metadata for :meth:`write` and :meth:`attend` (rows follow ``items`` in order)."""

    def write(self, layer: int, kv: torch.Tensor, plan: Any) -> None:
        """Store this step's K/V, ``kv`` (rows, 2 * kv_heads, head_dim), in their cache slots."""

    def attend(self, layer: int, qkv: torch.Tensor, plan: Any) -> torch.Tensor:
        """qkv: (rows, heads + 2 * kv_heads, head_dim) → (rows, heads * head_dim)."""


@dataclass(slots=True)
class _Prefill:
    """A multi-token item: attention over its own rows (``context`` None: it starts the sequence)
    or over the cached context plus them."""

    rows: slice
    context: torch.Tensor | None = None  # block ids covering tokens [0, end)
    length: int = 0  # end
    mask: torch.Tensor | None = None  # (rows, length), additive: row i sees tokens <= start + i
    start: int = 0
    table: torch.Tensor | None = None  # block ids covering tokens [0, end), for the C kernel


@dataclass(slots=True)
class SdpaPlan:
    """How attention reads the cache this step (the same for every layer, so built once).

    Single-token decodes share one attention call over their padded, masked contexts; every
    other item (a prefill chunk) gets its own call.
    """

    new_slots: torch.Tensor  # cache slot of every row computed this step
    prefills: list[_Prefill]
    decode_rows: torch.Tensor | None = None  # (B,) rows of the decodes, when prefills share the step
    decode_blocks: torch.Tensor | None = None  # (B * widest,) block ids, padded with block 0
    decode_length: int = 0  # the longest decode context: columns read of each padded row
    decode_ends: torch.Tensor | None = None  # (B,) each decode's context length (the C kernel's)
    decode_blocked: torch.Tensor | None = None  # (B, 1, 1, decode_length): True past a row's end


# NOTE: a CPU decode attention up to this many cached K/V values runs on one thread. Each of its
# five operators (gather, upcast, two products, softmax) would otherwise be a parallel region, and
# every region wakes the other threads: 120 of a decode step's 217 regions on a 24-layer model,
# ~0.1 ms each where idle threads sleep (as ``mmcache serve`` sets them to), for ~0.1 ms of work.
SERIAL_DECODE_VALUES = 1 << 20


@contextmanager
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask as the additive one SDPA would otherwise build in every layer."""
    blocked = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return blocked.masked_fill_(~allowed, float("-inf"))


class SdpaBackend:
    def __init__(self, kv: KVCache, num_heads: int, scaling: float):
        self.kv = kv
        self.num_heads = num_heads
        self.scaling = scaling
        self.device = kv.kv.device
        self.dtype = kv.kv.dtype
        # decode attention in one C call (a bfloat16 or float32 cache on a CPU), split over the
        # kernels' helper threads where the step has several kv heads' worth of work
        self.kernels = cpu_kernels.usable(kv.kv, dtypes=(torch.bfloat16, torch.float32))
        if self.kernels is not None:
            self.kernels.start_helpers()
        # prefill attention in one C call too, for the head sizes it is built for
        self.prefill_kernel = self.kernels is not None and kv.kv.shape[-1] in cpu_kernels.PREFILL_HEAD_DIMS

    def plan(self, items: list[StepItem]) -> SdpaPlan:
        size = self.kv.block_size
        new_slots: list[int] = []
        prefills = []
        decodes: list[StepItem] = []
        decode_rows: list[int] = []
        row = 0
        for item in items:
            table, start, end = item.seq.block_table, item.start, item.end
            new_slots += [table[t // size] * size + t % size for t in range(start, end)]
            if end - start == 1 and start > 0:
                decodes.append(item)
                decode_rows.append(row)
                row += 1
                continue
            prefill = _Prefill(slice(row, row + end - start), start=start)
            row += end - start
            if self.prefill_kernel:  # reads the cache through the table: no gather, no mask
                prefill.table = torch.tensor(table[: -(-end // size)], device=self.device)
            elif start > 0:
                prefill.context = torch.tensor(table[: -(-end // size)], device=self.device)
                prefill.length = end
                cols = torch.arange(end, device=self.device)
                rows = torch.arange(start, end, device=self.device)
                prefill.mask = _additive(cols[None, :] <= rows[:, None], self.dtype)
            prefills.append(prefill)
        plan = SdpaPlan(torch.tensor(new_slots, device=self.device), prefills)
        if decodes:
            length = max(it.end for it in decodes)
            widest = -(-length // size)
            tables = [it.seq.block_table[:widest] for it in decodes]
            plan.decode_blocks = torch.tensor(
                [b for t in tables for b in t + [0] * (widest - len(t))], device=self.device
            )
            plan.decode_length = length
            if self.kernels is not None:
                plan.decode_ends = torch.tensor([it.end for it in decodes], device=self.device)
            elif len(decodes) > 1:
                ends = torch.tensor([it.end for it in decodes], device=self.device)
                cols = torch.arange(length, device=self.device)
                plan.decode_blocked = (cols[None, :] >= ends[:, None])[:, None, None]
            if prefills:
                plan.decode_rows = torch.tensor(decode_rows, device=self.device)
        return plan

    def write(self, layer: int, kv: torch.Tensor, plan: SdpaPlan) -> None:
        self.kv.kv[layer].index_copy_(0, plan.new_slots, kv)

    def attend(self, layer: int, qkv: torch.Tensor, plan: SdpaPlan) -> torch.Tensor:
        q = qkv[:, : self.num_heads]
        if not plan.prefills:  # decodes only: one call, rows in order
            return self._decode(layer, q, plan).view(q.shape[0], -1)
        if len(plan.prefills) == 1 and plan.decode_rows is None:  # one item: its rows are all the rows
            return self._prefill(layer, q, qkv, plan.prefills[0]).reshape(q.shape[0], -1)
        out = torch.empty_like(q)
        for p in plan.prefills:
            out[p.rows] = self._prefill(layer, q, qkv, p)
        if plan.decode_rows is not None:
            out[plan.decode_rows] = self._decode(layer, q[plan.decode_rows], plan)
        return out.view(out.shape[0], -1)

    def _prefill(self, layer: int, q: torch.Tensor, qkv: torch.Tensor, p: _Prefill) -> torch.Tensor:
        """One prefill chunk's rows: → (rows, heads, head_dim), a view."""
        heads, kv_heads = self.num_heads, self.kv.num_kv_heads
        if p.table is not None:
            assert self.kernels is not None
            return cpu_kernels.prefill_attention(
                self.kernels, q[p.rows], self.kv.blocks(layer), p.table, p.start, kv_heads, self.scaling
            )
        query = q[p.rows].transpose(0, 1)[None]
        if p.context is None:  # the sequence's first tokens: K/V are right here
            kv = qkv[p.rows, heads:]
        else:
            kv = self.kv.blocks(layer).index_select(0, p.context).flatten(0, 1)[: p.length]
        keys = kv[:, :kv_heads].transpose(0, 1)[None]
        values = kv[:, kv_heads:].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(
            query,
            keys,
            values,
            attn_mask=p.mask,
            is_causal=p.context is None and query.shape[2] > 1,
            scale=self.scaling,
            enable_gqa=True,
        )
        return o[0].transpose(0, 1)

    def _decode(self, layer: int, q: torch.Tensor, plan: SdpaPlan) -> torch.Tensor:
        """One token of each of B sequences: q (B, heads, head_dim) → (B, heads, head_dim).

        In float32 whatever the cache's dtype (as the fused kernels accumulate); query head ``h``
        reads kv head ``h // (heads // kv_heads)``, as ``enable_gqa`` maps them.
        """
        batch, kv_heads, dim = q.shape[0], self.kv.num_kv_heads, q.shape[-1]
        if self.kernels is not None:
            return self._decode_kernel(self.kernels, layer, q, plan)
        small = batch * plan.decode_length * kv_heads * dim <= SERIAL_DECODE_VALUES
        with _one_thread() if small and self.device.type == "cpu" else nullcontext():
            return self._decode_attention(layer, q, plan)

    def _decode_kernel(
        self, lib: cpu_kernels.Kernels, layer: int, q: torch.Tensor, plan: SdpaPlan
    ) -> torch.Tensor:
        """:meth:`_decode` as one C call reading the blocks in place (no gather, no float32 copy)."""
        batch, heads, dim = q.shape
        assert q.stride(2) == 1 and q.stride(1) == dim and plan.decode_blocks is not None
        assert plan.decode_ends is not None
        cache = self.kv.blocks(layer)
        assert cache.is_contiguous()
        out = torch.empty((batch, heads, dim), dtype=q.dtype)
        call = lib.decode_attention if cache.dtype == torch.bfloat16 else lib.decode_attention_f32
        assert q.dtype == cache.dtype
        call(
            q.data_ptr(),
            q.stride(0),
            cache.data_ptr(),
            self.kv.block_size,
            plan.decode_blocks.data_ptr(),
            plan.decode_blocks.shape[0] // batch,
            plan.decode_ends.data_ptr(),
            out.data_ptr(),
            batch,
            heads,
            self.kv.num_kv_heads,
            dim,
            self.scaling,
        )
        return out

    def _decode_attention(self, layer: int, q: torch.Tensor, plan: SdpaPlan) -> torch.Tensor:
        batch, kv_heads, dim = q.shape[0], self.kv.num_kv_heads, q.shape[-1]
        cache = self.kv.blocks(layer)
        assert plan.decode_blocks is not None  # set with the decodes
        kv = cache.index_select(0, plan.decode_blocks).view(batch, -1, *cache.shape[2:])
        kv = kv[:, : plan.decode_length].float()  # (B, T, 2 * kv_heads, head_dim)
        keys = kv[:, :, :kv_heads].permute(0, 2, 3, 1)  # (B, kv_heads, head_dim, T)
        values = kv[:, :, kv_heads:].transpose(1, 2)  # (B, kv_heads, T, head_dim)
        scores = torch.matmul(q.float().view(batch, kv_heads, -1, dim), keys).mul_(self.scaling)
        if plan.decode_blocked is not None:
            scores.masked_fill_(plan.decode_blocked, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), values)  # (B, kv_heads, group, head_dim)
        return out.view(batch, self.num_heads, dim).to(q.dtype)
