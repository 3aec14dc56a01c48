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
    context: torch.Tensor  # slots of tokens [0, end)


class ModelRunner:
    def __init__(self, lm: TextLM, kv: KVCache):
        self.lm = lm
        self.kv = kv
        self.device = kv.k.device
        self._block_offsets = torch.arange(kv.block_size, device=self.device)

    def _slots(self, seq: Sequence, end: int) -> torch.Tensor:
        table = torch.tensor(seq.block_table, dtype=torch.long, device=self.device)
        return (table[:, None] * self.kv.block_size + self._block_offsets).reshape(-1)[:end]

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
            end = start + n
            items.append(_Item(seq, start, end, row, self._slots(seq, end)))
            ids += seq.token_ids[start:end]
            positions.append(seq.positions_for(start, end))
            row += n
        hidden = self.lm.embed(torch.tensor(ids, dtype=torch.long, device=self.device))
        for item in items:
            self._place_media(hidden, item)
        cos, sin = self.lm.rope(hidden, torch.cat(positions, dim=1).to(self.device))
        new_slots = torch.cat([item.context[item.start :] for item in items])
        for layer_idx, layer in enumerate(self.lm.layers):
            hidden = self._layer(layer_idx, layer, hidden, cos, sin, items, new_slots)
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

    def _layer(self, idx, layer, hidden, cos, sin, items, new_slots) -> torch.Tensor:
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
        k_cache[new_slots] = k[0].transpose(0, 1)
        v_cache[new_slots] = v
        out = self._attention(q, k_cache, v_cache, items)
        hidden = residual + attn.o_proj(out)
        residual = hidden
        return residual + layer.mlp(layer.post_attention_layernorm(hidden))

    def _attention(self, q: torch.Tensor, k_cache, v_cache, items: list[_Item]) -> torch.Tensor:
        """q: (1, heads, rows, head_dim) → (rows, heads * head_dim)."""
        out = torch.empty_like(q[0].transpose(0, 1))  # (rows, heads, head_dim)
        decodes = [it for it in items if it.end - it.start == 1 and it.start > 0]
        batched: set[int] = set()
        if len(decodes) > 1:
            self._batched_decode(q, k_cache, v_cache, decodes, out)
            batched = {id(it) for it in decodes}
        for item in items:
            if id(item) in batched:
                continue
            rows = slice(item.row, item.row + item.end - item.start)
            keys = k_cache[item.context].transpose(0, 1)[None]
            values = v_cache[item.context].transpose(0, 1)[None]
            query = q[:, :, rows]
            mask = None
            causal = item.start == 0 and item.end > 1
            if item.start > 0 and item.end - item.start > 1:
                cols = torch.arange(item.end, device=q.device)
                mask = cols[None, :] <= torch.arange(item.start, item.end, device=q.device)[:, None]
            o = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=mask, is_causal=causal, scale=self.lm.scaling, enable_gqa=True
            )
            out[rows] = o[0].transpose(0, 1)
        return out.reshape(out.shape[0], -1)

    def _batched_decode(self, q, k_cache, v_cache, items: list[_Item], out: torch.Tensor) -> None:
        longest = max(it.end for it in items)
        slots = torch.zeros(len(items), longest, dtype=torch.long, device=q.device)
        mask = torch.zeros(len(items), 1, 1, longest, dtype=torch.bool, device=q.device)
        for b, item in enumerate(items):
            slots[b, : item.end] = item.context
            mask[b, 0, 0, : item.end] = True
        keys = k_cache[slots].transpose(1, 2)  # (B, kv_heads, longest, head_dim)
        values = v_cache[slots].transpose(1, 2)
        rows = torch.tensor([it.row for it in items], device=q.device)
        query = q[0, :, rows].transpose(0, 1)[:, :, None]  # (B, heads, 1, head_dim)
        o = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=self.lm.scaling, enable_gqa=True
        )
        out[rows] = o[:, :, 0]
