"""Forward passes of the text model over the paged KV cache.

One step computes, for each scheduled sequence, a contiguous range of its tokens
(a prefill chunk or one decode token). All rows go through the projections and
MLPs together; attention reads each sequence's K/V from its blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb

from llm_stage.sequence import Sequence
from llm_stage.text_model import TextLM


class KVCache:
    """K and V for every layer: (layers, num_blocks * block_size, kv_heads, head_dim) each."""

    def __init__(
        self, lm: TextLM, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype
    ):
        shape = (len(lm.layers), num_blocks * block_size, lm.num_kv_heads, lm.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(lm: TextLM, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * len(lm.layers) * block_size * lm.num_kv_heads * lm.head_dim * itemsize


@dataclass(slots=True)
class _Item:
    seq: Sequence
    start: int  # first token computed this step
    end: int  # one past the last
    row: int  # first row in the batch


@dataclass(slots=True)
class _Plan:
    """How attention reads the cache this step (the same for every layer, so built once).

    Single-token decodes share one padded, masked attention call; every other item
    (a prefill chunk) gets its own call over its context.
    """

    new_slots: torch.Tensor  # cache slot of every row computed this step
    prefills: list[tuple[slice, torch.Tensor, torch.Tensor | None, bool]]  # rows, context, mask, causal
    decode_rows: torch.Tensor | None = None  # (B,)
    decode_slots: torch.Tensor | None = None  # (B, longest)
    decode_mask: torch.Tensor | None = None  # (B, 1, 1, longest)


class ModelRunner:
    def __init__(self, lm: TextLM, kv: KVCache):
        self.lm = lm
        self.kv = kv
        self.device = kv.k.device
        self._block_offsets = torch.arange(kv.block_size, device=self.device)

    def copy_block_start(self, source: int, target: int, tokens: int) -> None:
        """Copy the K/V of the first ``tokens`` slots of block ``source`` into block ``target``."""
        src, dst = source * self.kv.block_size, target * self.kv.block_size
        for cache in (self.kv.k, self.kv.v):
            cache[:, dst : dst + tokens] = cache[:, src : src + tokens]

    def _slots(self, tables: list[list[int]], length: int) -> torch.Tensor:
        """Cache slots of tokens ``[0, length)`` for each block table: (len(tables), length)."""
        width = -(-length // self.kv.block_size)
        table = torch.tensor([t[:width] + [0] * (width - len(t[:width])) for t in tables], device=self.device)
        return (table[:, :, None] * self.kv.block_size + self._block_offsets).reshape(len(tables), -1)[
            :, :length
        ]

    def _plan(self, items: list[_Item]) -> _Plan:
        decodes = [it for it in items if it.end - it.start == 1 and it.start > 0]
        if len(decodes) < 2:
            decodes = []
        batched = {id(it) for it in decodes}
        new_slots: list[torch.Tensor] = []
        prefills = []
        for item in items:
            if id(item) in batched:
                continue
            context = self._slots([item.seq.block_table], item.end)[0]
            mask = None
            if item.start > 0 and item.end - item.start > 1:
                cols = torch.arange(item.end, device=self.device)
                mask = cols[None, :] <= torch.arange(item.start, item.end, device=self.device)[:, None]
            rows = slice(item.row, item.row + item.end - item.start)
            prefills.append((rows, context, mask, item.start == 0 and item.end > 1))
            new_slots.append((rows.start, context[item.start :]))
        plan = _Plan(torch.empty(0), prefills)
        if decodes:
            longest = max(it.end for it in decodes)
            slots = self._slots([it.seq.block_table for it in decodes], longest)
            ends = torch.tensor([it.end for it in decodes], device=self.device)
            plan.decode_rows = torch.tensor([it.row for it in decodes], device=self.device)
            plan.decode_slots = slots
            plan.decode_mask = (torch.arange(longest, device=self.device)[None, :] < ends[:, None])[
                :, None, None
            ]
            new_slots += [(it.row, slots[b, it.start : it.end]) for b, it in enumerate(decodes)]
        new_slots.sort(key=lambda rs: rs[0])
        plan.new_slots = torch.cat([s for _, s in new_slots])
        return plan

    @torch.inference_mode()
    def run(self, batch: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Compute ``n`` more tokens of each ``(seq, n)``; returns logits (float32) for every sequence
        whose step reaches its last token, in batch order."""
        items: list[_Item] = []
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        row = 0
        for seq, n in batch:
            start = seq.num_computed_tokens
            items.append(_Item(seq, start, start + n, row))
            ids += seq.token_ids[start : start + n]
            positions.append(seq.positions_for(start, start + n))
            row += n
        hidden = self.lm.embed(torch.tensor(ids, dtype=torch.long, device=self.device))
        for item in items:
            self._place_media(hidden, item)
        cos, sin = self.lm.rope(hidden, torch.cat(positions, dim=1).to(self.device))
        plan = self._plan(items)
        for layer_idx, layer in enumerate(self.lm.layers):
            hidden = self._layer(layer_idx, layer, hidden, cos, sin, plan)
        last_rows = [
            item.row + item.end - item.start - 1 for item in items if item.end == item.seq.num_tokens
        ]
        if not last_rows:
            return hidden.new_empty((0, self.lm.vocab_size), dtype=torch.float32)
        return self.lm.logits(hidden[last_rows])

    def _place_media(self, hidden: torch.Tensor, item: _Item) -> None:
        for media in item.seq.media:
            lo, hi = max(item.start, media.start), min(item.end, media.end)
            if lo < hi:
                rows = media.rows[lo - media.start : hi - media.start]
                hidden[item.row + lo - item.start : item.row + hi - item.start] = rows.to(hidden.dtype)

    def _layer(self, idx, layer, hidden, cos, sin, plan: _Plan) -> torch.Tensor:
        lm = self.lm
        n = hidden.shape[0]
        residual = hidden
        x = layer.input_layernorm(hidden)
        attn = layer.self_attn
        q = attn.q_proj(x).view(1, n, lm.num_heads, lm.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(1, n, lm.num_kv_heads, lm.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(n, lm.num_kv_heads, lm.head_dim)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k_cache, v_cache = self.kv.k[idx], self.kv.v[idx]
        k_cache[plan.new_slots] = k[0].transpose(0, 1)
        v_cache[plan.new_slots] = v
        out = self._attention(q, k_cache, v_cache, plan)
        hidden = residual + attn.o_proj(out)
        residual = hidden
        return residual + layer.mlp(layer.post_attention_layernorm(hidden))

    def _attention(self, q: torch.Tensor, k_cache, v_cache, plan: _Plan) -> torch.Tensor:
        """q: (1, heads, rows, head_dim) → (rows, heads * head_dim)."""
        out = torch.empty_like(q[0].transpose(0, 1))  # (rows, heads, head_dim)
        scale = self.lm.scaling
        # NOTE: index_select, not advanced indexing: the same gather, several times faster on CPU.
        for rows, context, mask, causal in plan.prefills:
            keys = k_cache.index_select(0, context).transpose(0, 1)[None]
            values = v_cache.index_select(0, context).transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(
                q[:, :, rows], keys, values, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
            )
            out[rows] = o[0].transpose(0, 1)
        if plan.decode_rows is not None:
            slots = plan.decode_slots.reshape(-1)
            shape = (*plan.decode_slots.shape, *k_cache.shape[1:])  # (B, longest, kv_heads, head_dim)
            keys = k_cache.index_select(0, slots).view(shape).transpose(1, 2)
            values = v_cache.index_select(0, slots).view(shape).transpose(1, 2)
            query = q[0, :, plan.decode_rows].transpose(0, 1)[:, :, None]  # (B, heads, 1, head_dim)
            o = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=plan.decode_mask, scale=scale, enable_gqa=True
            )
            out[plan.decode_rows] = o[:, :, 0]
        return out.reshape(out.shape[0], -1)
