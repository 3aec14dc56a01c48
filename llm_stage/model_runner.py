"""Forward passes of the text model over the paged KV cache.

One step computes, for each scheduled sequence, a contiguous range of its tokens
(a prefill chunk or one decode token). All rows go through the projections and
MLPs together; attention reads each sequence's K/V from its blocks.

On a small model a step costs more in operator calls than in arithmetic, so the
layer is written with few of them: one projection for q, k and v, one for the
MLP's gate and up, rotary embedding in place on q and k together, and K and V of
a slot side by side in one cache row (one write and one gather serve both).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llm_stage.sequence import Sequence
from llm_stage.text_model import LayerWeights, TextLM, qk_norm_
from llm_stage.visual_rows import VisualRows


class KVCache:
    """K and V of every layer in one tensor: (layers, num_blocks * block_size, 2 * kv_heads, head_dim).

    A slot's row holds its K heads, then its V heads.
    """

    def __init__(
        self, lm: TextLM, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype
    ):
        shape = (len(lm.layers), num_blocks * block_size, 2 * lm.num_kv_heads, lm.head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.num_kv_heads = lm.num_kv_heads
        self.num_blocks = num_blocks
        self.block_size = block_size

    @property
    def k(self) -> torch.Tensor:
        return self.kv[:, :, : self.num_kv_heads]

    @property
    def v(self) -> torch.Tensor:
        return self.kv[:, :, self.num_kv_heads :]

    def blocks(self, layer: int) -> torch.Tensor:
        """Layer ``layer`` as (num_blocks, block_size, 2 * kv_heads, head_dim)."""
        return self.kv[layer].view(self.num_blocks, self.block_size, *self.kv.shape[2:])

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
class _Prefill:
    """A multi-token item: attention over its own rows (``context`` None: it starts the sequence)
    or over the cached context plus them."""

    rows: slice
    context: torch.Tensor | None = None  # block ids covering tokens [0, end)
    length: int = 0  # end
    mask: torch.Tensor | None = None  # (rows, length), additive: row i sees tokens <= start + i


@dataclass(slots=True)
class _Plan:
    """How attention reads the cache this step (the same for every layer, so built once).

    Single-token decodes share one padded, masked attention call; every other item
    (a prefill chunk) gets its own call.
    """

    new_slots: torch.Tensor  # cache slot of every row computed this step
    prefills: list[_Prefill]
    decode_rows: torch.Tensor | None = None  # (B,) rows of the decodes, when prefills share the step
    decode_blocks: torch.Tensor | None = None  # (B * widest,) block ids, padded with block 0
    decode_mask: torch.Tensor | None = None  # (B, 1, 1, widest * block_size), additive


_Rope = tuple[torch.Tensor, torch.Tensor]  # cos and folded sin of every row, (rows, 1, head_dim)


def fold_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated: ``rotate_half(x) * sin == roll(x, half) * fold_sin(sin)``
    exactly (only where the sign sits moves), so the rotation needs no slicing and concatenation."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def rotate_(x: torch.Tensor, cos: torch.Tensor, folded_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in place: the reference's ``x * cos + rotate_half(x) * sin``, bit for bit."""
    rotated = x.roll(x.shape[-1] // 2, -1).mul_(folded_sin)
    return x.mul_(cos).add_(rotated)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask as the additive one SDPA would otherwise build in every layer."""
    blocked = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return blocked.masked_fill_(~allowed, float("-inf"))


class ModelRunner:
    def __init__(self, lm: TextLM, kv: KVCache):
        self.lm = lm
        self.kv = kv
        self.device = kv.kv.device
        self.dtype = kv.kv.dtype

    def copy_block_start(self, source: int, target: int, tokens: int) -> None:
        """Copy the K/V of the first ``tokens`` slots of block ``source`` into block ``target``."""
        src, dst = source * self.kv.block_size, target * self.kv.block_size
        self.kv.kv[:, dst : dst + tokens] = self.kv.kv[:, src : src + tokens]

    def _plan(self, items: list[_Item]) -> _Plan:
        size = self.kv.block_size
        decodes = [it for it in items if it.end - it.start == 1 and it.start > 0]
        if len(decodes) < 2:
            decodes = []
        batched = {id(it) for it in decodes}
        new_slots: list[int] = []
        prefills = []
        for item in items:
            table, start, end = item.seq.block_table, item.start, item.end
            new_slots += [table[t // size] * size + t % size for t in range(start, end)]
            if id(item) in batched:
                continue
            prefill = _Prefill(slice(item.row, item.row + end - start))
            if start > 0:
                prefill.context = torch.tensor(table[: -(-end // size)], device=self.device)
                prefill.length = end
                if end - start > 1:
                    cols = torch.arange(end, device=self.device)
                    rows = torch.arange(start, end, device=self.device)
                    prefill.mask = _additive(cols[None, :] <= rows[:, None], self.dtype)
            prefills.append(prefill)
        plan = _Plan(torch.tensor(new_slots, device=self.device), prefills)
        if decodes:
            widest = max(-(-it.end // size) for it in decodes)
            tables = [it.seq.block_table[:widest] for it in decodes]
            plan.decode_blocks = torch.tensor(
                [b for t in tables for b in t + [0] * (widest - len(t))], device=self.device
            )
            ends = torch.tensor([it.end for it in decodes], device=self.device)
            cols = torch.arange(widest * size, device=self.device)
            plan.decode_mask = _additive(cols[None, :] < ends[:, None], self.dtype)[:, None, None]
            if prefills:
                plan.decode_rows = torch.tensor([it.row for it in decodes], device=self.device)
        return plan

    @torch.inference_mode()
    def run(self, batch: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Compute ``n`` more tokens of each ``(seq, n)``; returns logits (float32) for every sequence
        whose step reaches its last token, in batch order."""
        items: list[_Item] = []
        ids: list[int] = []
        row = 0
        for seq, n in batch:
            start = seq.num_computed_tokens
            items.append(_Item(seq, start, start + n, row))
            ids += seq.token_ids[start : start + n]
            row += n
        hidden = self.lm.embed(torch.tensor(ids, dtype=torch.long, device=self.device))
        visual = VisualRows.gather([(it.row, it.start, it.end, it.seq.media) for it in items], hidden)
        if visual is not None:
            visual.place(hidden)
        rope = self._rope(hidden, items)
        plan = self._plan(items)
        for idx, weights in enumerate(self.lm.fused):
            hidden = self._layer(idx, weights, hidden, rope, plan)
            if visual is not None:
                visual.add_deepstack(hidden, idx)
        last_rows = [
            item.row + item.end - item.start - 1 for item in items if item.end == item.seq.num_tokens
        ]
        if not last_rows:
            return hidden.new_empty((0, self.lm.vocab_size), dtype=torch.float32)
        if len(last_rows) < hidden.shape[0]:
            hidden = hidden[last_rows]
        return self.lm.logits(hidden)

    def _rope(self, hidden: torch.Tensor, items: list[_Item]) -> _Rope:
        """cos and folded sin (:func:`fold_sin`) of every row, shaped (rows, 1, head_dim)."""
        parts: list[torch.Tensor] = []
        generated: list[int] = []  # positions of generated tokens, gathered into one tensor
        for item in items:
            seq = item.seq
            if item.start >= seq.num_prompt_tokens:
                generated += range(item.start + seq.rope_delta, item.end + seq.rope_delta)
                continue
            if generated:
                parts.append(torch.tensor(generated).expand(3, -1))
                generated = []
            parts.append(seq.positions_for(item.start, item.end))
        if generated:
            parts.append(torch.tensor(generated).expand(3, -1))
        positions = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        cos, sin = self.lm.rope(hidden, positions.to(self.device))
        return cos[0, :, None], fold_sin(sin)[0, :, None]

    def _layer(
        self, idx: int, w: LayerWeights, hidden: torch.Tensor, rope: _Rope, plan: _Plan
    ) -> torch.Tensor:
        lm = self.lm
        n, heads, kv_heads = hidden.shape[0], lm.num_heads, lm.num_kv_heads
        x = F.rms_norm(hidden, w.norm_shape, w.input_norm, w.eps)
        qkv = F.linear(x, w.qkv, w.qkv_bias).view(n, heads + 2 * kv_heads, lm.head_dim)
        if w.qk_norm is not None:
            qk_norm_(qkv[:, : heads + kv_heads], w)
        rotate_(qkv[:, : heads + kv_heads], *rope)
        self.kv.kv[idx].index_copy_(0, plan.new_slots, qkv[:, heads:])
        out = self._attention(idx, qkv, plan)
        hidden = hidden + F.linear(out, w.o)
        x = F.rms_norm(hidden, w.norm_shape, w.post_norm, w.eps)
        if w.moe is not None:
            return hidden + w.moe(x[None])[0]
        gate, up = F.linear(x, w.gate_up).chunk(2, dim=-1)
        return hidden + F.linear(w.act(gate) * up, w.down)

    def _attention(self, idx: int, qkv: torch.Tensor, plan: _Plan) -> torch.Tensor:
        """qkv: (rows, heads + 2 * kv_heads, head_dim) → (rows, heads * head_dim)."""
        lm = self.lm
        heads, kv_heads, scale = lm.num_heads, lm.num_kv_heads, lm.scaling
        q = qkv[:, :heads]
        if not plan.prefills:  # decodes only: one call, rows in order
            return self._decode(idx, q, plan).view(q.shape[0], -1)
        out = torch.empty_like(q)
        for p in plan.prefills:
            query = q[p.rows].transpose(0, 1)[None]
            if p.context is None:  # the sequence's first tokens: K/V are right here
                kv = qkv[p.rows, heads:]
            else:
                kv = self.kv.blocks(idx).index_select(0, p.context).flatten(0, 1)[: p.length]
            keys = kv[:, :kv_heads].transpose(0, 1)[None]
            values = kv[:, kv_heads:].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(
                query,
                keys,
                values,
                attn_mask=p.mask,
                is_causal=p.context is None and query.shape[2] > 1,
                scale=scale,
                enable_gqa=True,
            )
            out[p.rows] = o[0].transpose(0, 1)
        if plan.decode_rows is not None:
            out[plan.decode_rows] = self._decode(idx, q[plan.decode_rows], plan)
        return out.view(out.shape[0], -1)

    def _decode(self, idx: int, q: torch.Tensor, plan: _Plan) -> torch.Tensor:
        """One token of each of B sequences: q (B, heads, head_dim) → (B, heads, head_dim)."""
        kv_heads = self.lm.num_kv_heads
        cache = self.kv.blocks(idx)
        kv = cache.index_select(0, plan.decode_blocks).view(q.shape[0], -1, *cache.shape[2:])
        keys = kv[:, :, :kv_heads].transpose(1, 2)  # (B, kv_heads, widest * block_size, head_dim)
        values = kv[:, :, kv_heads:].transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q[:, :, None], keys, values, attn_mask=plan.decode_mask, scale=self.lm.scaling, enable_gqa=True
        )
        return o[:, :, 0]
