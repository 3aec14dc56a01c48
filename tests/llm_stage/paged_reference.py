"""Attention that reads only what a :class:`~llm_stage.paged_layout.PagedLayout` says (query rows,
pages, last-page lengths), in SDPA on any device: the CSR semantics FlashInfer's paged kernels
read, with FlashInfer's graph-plan contract (fixed buffers refilled before each replay). The CPU
tests drive the CUDA-graph runner with it; it is no serving backend (one SDPA call per item)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mmcache.llm_stage.kv_cache import KVCache
from mmcache.llm_stage.paged_layout import PagedLayout, paged_layout
from mmcache.llm_stage.scheduler import StepItem


@dataclass(frozen=True, slots=True)
class RefPlan:
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    last_page_len: torch.Tensor
    slots: torch.Tensor


class PagedReference:
    graphable = True

    def __init__(self, kv: KVCache, num_heads: int, scaling: float, max_pages_per_seq: int):
        self.kv = kv
        self.num_heads = num_heads
        self.scaling = scaling
        self.max_pages_per_seq = max_pages_per_seq
        self.device = kv.kv.device

    def _tensors(self, layout: PagedLayout) -> RefPlan:
        def t(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        return RefPlan(
            t(layout.qo_indptr),
            t(layout.kv_indptr),
            t(layout.kv_indices),
            t(layout.last_page_len),
            t(layout.slots),
        )

    def plan(self, items: list[StepItem]) -> RefPlan:
        return self._tensors(paged_layout(items, self.kv.block_size))

    def graph_plan(self, batch: int) -> RefPlan:
        def z(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.long, device=self.device)

        return RefPlan(z(batch + 1), z(batch + 1), z(batch * self.max_pages_per_seq), z(batch), z(batch))

    def update_graph_plan(self, plan: RefPlan, layout: PagedLayout) -> None:
        fresh = self._tensors(layout)
        for name in ("qo_indptr", "kv_indptr", "last_page_len", "slots"):
            getattr(plan, name).copy_(getattr(fresh, name))
        plan.kv_indices.zero_()[: len(layout.kv_indices)].copy_(fresh.kv_indices)

    def write(self, layer: int, kv: torch.Tensor, plan: RefPlan) -> None:
        self.kv.kv[layer].index_copy_(0, plan.slots, kv)

    def attend(self, layer: int, qkv: torch.Tensor, plan: RefPlan) -> torch.Tensor:
        heads, kv_heads, size = self.num_heads, self.kv.num_kv_heads, self.kv.block_size
        qo, kv_ptr, pages, last = (
            x.tolist() for x in (plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.last_page_len)
        )
        cache = self.kv.blocks(layer)
        out = torch.empty_like(qkv[:, :heads])
        for i in range(len(last)):
            own = pages[kv_ptr[i] : kv_ptr[i + 1]]
            length = (len(own) - 1) * size + last[i]
            kv = cache[own].flatten(0, 1)[:length]
            q = qkv[qo[i] : qo[i + 1], :heads]
            n = q.shape[0]
            allowed = (
                torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
            )  # bottom-right
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                kv[:, :kv_heads].transpose(0, 1)[None],
                kv[:, kv_heads:].transpose(0, 1)[None],
                attn_mask=allowed.to(self.device),
                scale=self.scaling,
                enable_gqa=True,
            )
            out[qo[i] : qo[i + 1]] = o[0].transpose(0, 1)
        return out.view(out.shape[0], -1)
