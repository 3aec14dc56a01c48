"""Attention through FlashInfer's paged kernels, reading K/V straight from the block pool.

Imported only when FlashInfer is chosen (:mod:`llm_stage.attention_select`): this module
imports ``flashinfer`` at the top and needs CUDA.

Layout: the pool keeps a slot's K heads then its V heads in one row, a layer being
(num_blocks, block_size, 2 * kv_heads, head_dim). FlashInfer's NHD page layout is
(num_pages, page_size, kv_heads, head_dim) for K and for V, and it takes them as two
strided tensors; the K and V halves of our rows are exactly such views (page stride
block_size * 2 * kv_heads * head_dim, token stride 2 * kv_heads * head_dim, head stride
head_dim), so nothing is copied or re-laid out, and the write path is the SDPA one.

One prefill wrapper (causal, bottom-right aligned) serves every step: prefill chunks,
chunks over a cached prefix and single-token decodes alike. For CUDA graphs each captured
batch size gets a wrapper of its own over fixed buffers (:meth:`graph_plan`), re-planned
before every replay (:meth:`update_graph_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import flashinfer
import torch

from mmcache.llm_stage.kv_cache import KVCache
from mmcache.llm_stage.paged_layout import PagedLayout, paged_layout
from mmcache.llm_stage.scheduler import StepItem

WORKSPACE_BYTES = 128 << 20  # FlashInfer's float workspace (split-KV partial results), one per backend


@dataclass(frozen=True, slots=True)
class FlashInferPlan:
    wrapper: Any  # a planned flashinfer.BatchPrefillWithPagedKVCacheWrapper
    slots: torch.Tensor  # (rows,) int64 cache slot of every row computed this step


def _int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


class FlashInferBackend:
    graphable = True  # plan metadata lives in fixed buffers: decode steps can be captured

    def __init__(self, kv: KVCache, num_heads: int, scaling: float, max_pages_per_seq: int = 0):
        self.kv = kv
        self.num_heads = num_heads
        self.scaling = scaling
        self.device = kv.kv.device
        self.dtype = kv.kv.dtype
        self.head_dim = kv.kv.shape[-1]
        self.max_pages_per_seq = max_pages_per_seq or kv.num_blocks
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        heads = kv.num_kv_heads
        # NOTE: views, not copies: K and V of layer i are the two halves of the pool's rows.
        self.caches = [
            (kv.blocks(i)[:, :, :heads], kv.blocks(i)[:, :, heads:]) for i in range(kv.kv.shape[0])
        ]

    def _plan(self, wrapper: Any, layout: PagedLayout) -> None:
        # NOTE: host tensors on purpose: plan reads the indptrs on the host anyway (device ones would
        # cost a sync) and copies what the kernel needs into its own (graph-fixed) buffers.
        wrapper.plan(
            qo_indptr=_int32(layout.qo_indptr),
            paged_kv_indptr=_int32(layout.kv_indptr),
            paged_kv_indices=_int32(layout.kv_indices),
            paged_kv_last_page_len=_int32(layout.last_page_len),
            num_qo_heads=self.num_heads,
            num_kv_heads=self.kv.num_kv_heads,
            head_dim_qk=self.head_dim,
            page_size=self.kv.block_size,
            causal=True,
            sm_scale=self.scaling,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )

    def plan(self, items: list[StepItem]) -> FlashInferPlan:
        layout = paged_layout(items, self.kv.block_size)
        self._plan(self.wrapper, layout)
        return FlashInferPlan(self.wrapper, torch.tensor(layout.slots, device=self.device))

    def write(self, layer: int, kv: torch.Tensor, plan: FlashInferPlan) -> None:
        self.kv.kv[layer].index_copy_(0, plan.slots, kv)

    def attend(self, layer: int, qkv: torch.Tensor, plan: FlashInferPlan) -> torch.Tensor:
        # NOTE: q is copied out of the fused qkv rows: the kernel then sees the plain (rows, heads,
        # head_dim) layout every FlashInfer version accepts (a small copy beside the attention).
        q = qkv[:, : self.num_heads].contiguous()
        out = plan.wrapper.run(q, self.caches[layer])
        return out.view(q.shape[0], -1)

    # --- CUDA graphs: a wrapper over fixed buffers per captured batch size ---------------------

    def graph_plan(self, batch: int) -> FlashInferPlan:
        """A plan for ``batch`` single-token rows whose tensors never move (graphs capture them)."""
        dev = self.device
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            qo_indptr_buf=torch.arange(batch + 1, dtype=torch.int32, device=dev),
            paged_kv_indptr_buf=torch.zeros(batch + 1, dtype=torch.int32, device=dev),
            paged_kv_indices_buf=torch.zeros(batch * self.max_pages_per_seq, dtype=torch.int32, device=dev),
            paged_kv_last_page_len_buf=torch.ones(batch, dtype=torch.int32, device=dev),
        )
        return FlashInferPlan(wrapper, torch.zeros(batch, dtype=torch.long, device=dev))

    def update_graph_plan(self, plan: FlashInferPlan, layout: PagedLayout) -> None:
        """Point a graph plan at this step's decodes (``layout`` already padded to its batch)."""
        self._plan(plan.wrapper, layout)
        plan.slots.copy_(torch.tensor(layout.slots))
