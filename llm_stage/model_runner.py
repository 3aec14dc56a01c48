"""Forward passes of the text model over the paged KV cache.

One step computes, for each scheduled sequence, a contiguous range of its tokens
(a prefill chunk or one decode token). All rows go through the projections and
MLPs together; attention (:mod:`llm_stage.attention`, a backend seam) reads each
sequence's K/V from its blocks.

On a small model a step costs more in operator calls than in arithmetic, so the
layer is written with few of them: one projection for q, k and v, one for the
MLP's gate and up, rotary embedding in place on q and k together, and K and V of
a slot side by side in one cache row (one write and one gather serve both).
"""

from __future__ import annotations

from typing import Any

import torch

from mmcache.llm_stage.attention import AttentionBackend, SdpaBackend
from mmcache.llm_stage.block_manager import BlockCopy
from mmcache.llm_stage.cpu_decode import CpuDecode
from mmcache.llm_stage.kv_cache import KVCache
from mmcache.llm_stage.prompt_logprobs import Scored, score
from mmcache.llm_stage.scheduler import StepItem
from mmcache.llm_stage.text_model import LayerWeights, TextLM, qk_norm_
from mmcache.llm_stage.visual_rows import VisualRows
from mmcache.shared import cpu_kernels

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


class ModelRunner:
    def __init__(self, lm: TextLM, kv: KVCache, attention: AttentionBackend | None = None):
        self.lm = lm
        self.kv = kv
        self.attention: AttentionBackend = attention or SdpaBackend(kv, lm.num_heads, lm.scaling)
        self.device = kv.kv.device
        # The layer's small operators as one C function each, where the model computes in bfloat16
        # or float32 on a CPU and the kernels built (:mod:`mmcache.shared.cpu_kernels`); else eager
        # PyTorch.
        self.kernels = cpu_kernels.usable(kv.kv, lm.head_norm, dtypes=(torch.bfloat16, torch.float32))
        self.fused_silu = self.kernels is not None and lm.config.hidden_act == "silu"
        # a decode-only step's layers in one C call, where they qualify (llm_stage/cpu_decode.py)
        self.cpu_decode = CpuDecode.build(lm, kv, self.attention)

    def copy_block_start(self, copy: BlockCopy) -> None:
        """Copy the K/V of a shared block start into the sequence's own block."""
        src, dst = copy.source * self.kv.block_size, copy.target * self.kv.block_size
        self.kv.kv[:, dst : dst + copy.tokens] = self.kv.kv[:, src : src + copy.tokens]

    @torch.inference_mode()
    def forward(self, items: list[StepItem]) -> tuple[torch.Tensor, list[Scored]]:
        """Compute each item's tokens: logits (float32) of every item that samples, in order, and
        the prompt logprobs of the items whose sequence asks for them.

        NOTE: only those rows go through the LM head besides the sampling ones: a step where nobody
        asks computes exactly what it did without prompt logprobs.
        """
        ids: list[int] = []
        rows: list[int] = []  # first row of each item
        last_rows = []
        row = 0
        for item in items:
            ids += item.seq.token_ids[item.start : item.end]
            rows.append(row)
            row += item.num_tokens
            if item.samples:
                last_rows.append(row - 1)
        hidden = self.lm.embed(torch.tensor(ids, dtype=torch.long, device=self.device))
        visual = VisualRows.gather(
            [(r, it.start, it.end, it.seq.media) for r, it in zip(rows, items, strict=True)], hidden
        )
        if visual is not None:
            visual.place(hidden)
        rope = self._rope(hidden, items)
        plan = self.attention.plan(items)
        if visual is None and self.cpu_decode is not None and self.cpu_decode.takes(hidden, plan):

            def loop_layer(idx: int, h: torch.Tensor) -> torch.Tensor:
                return self._layer(idx, self.lm.fused[idx], h, rope, plan)

            hidden = self.cpu_decode.run(hidden, rope, plan, loop_layer)
        else:
            for idx, weights in enumerate(self.lm.fused):
                hidden = self._layer(idx, weights, hidden, rope, plan)
                if visual is not None:
                    visual.add_deepstack(hidden, idx)
        scored = self._score(items, rows, hidden)
        if not last_rows:
            return hidden.new_empty((0, self.lm.vocab_size), dtype=torch.float32), scored
        if len(last_rows) < hidden.shape[0]:
            hidden = hidden[last_rows]
        return self.lm.logits(hidden), scored

    def _score(self, items: list[StepItem], rows: list[int], hidden: torch.Tensor) -> list[Scored]:
        """Row ``r`` of a prompt gives the entry of token ``r + 1`` (the last prompt row samples)."""
        out = []
        for first, item in zip(rows, items, strict=True):
            seq = item.seq
            end = min(item.end, seq.num_prompt_tokens - 1)
            if not seq.wants_prompt_logprobs or item.start >= end:
                continue
            n = end - item.start
            targets = torch.tensor(seq.token_ids[item.start + 1 : end + 1], device=hidden.device)
            ids, values = score(self.lm, hidden[first : first + n], targets)
            out.append(Scored(seq, item.start + 1, ids, values))
        return out

    def _rope(self, hidden: torch.Tensor, items: list[StepItem]) -> _Rope:
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

    def _layer(self, idx: int, w: LayerWeights, hidden: torch.Tensor, rope: _Rope, plan: Any) -> torch.Tensor:
        lm, lib = self.lm, self.kernels
        n, heads, kv_heads = hidden.shape[0], lm.num_heads, lm.num_kv_heads
        x = self._norm(hidden, w.input_norm, w)  # times qkv's input scale
        qkv = w.qkv.prescaled(x).view(n, heads + 2 * kv_heads, lm.head_dim)
        if w.qk_norm is not None:
            qk_norm_(qkv[:, : heads + kv_heads], w.qk_norm, w.qk_eps)
        if lib is not None:
            cpu_kernels.rotate_(lib, qkv[:, : heads + kv_heads], rope[0].view(n, -1), rope[1].view(n, -1))
        else:
            rotate_(qkv[:, : heads + kv_heads], *rope)
        self.attention.write(idx, qkv[:, heads:], plan)
        out = self.attention.attend(idx, qkv, plan)
        hidden = w.o.add_to(hidden, out)
        x = self._norm(hidden, w.post_norm, w)  # times gate_up's input scale
        if w.moe is not None:
            return hidden + w.moe(x[None])[0]
        assert w.gate_up is not None and w.act is not None and w.down is not None  # a dense MLP
        if self.fused_silu and lib is not None:
            return w.down.add_to(hidden, cpu_kernels.silu_mul(lib, w.gate_up.prescaled(x)))
        gate, up = w.gate_up.prescaled(x).chunk(2, dim=-1)
        return w.down.add_to(hidden, w.act(gate) * up)

    def _norm(self, hidden: torch.Tensor, weight: torch.Tensor, w: LayerWeights) -> torch.Tensor:
        return cpu_kernels.rms_norm_or_eager(self.kernels, hidden, weight, w.eps)

    def decode_logits(self, ids: torch.Tensor, rope: _Rope, plan: Any) -> torch.Tensor:
        """Logits (float32) of rows that each compute one generated token (no media rows, no prompt
        logprobs): the part of :meth:`forward` a CUDA graph captures (:mod:`llm_stage.cuda_graphs`)."""
        hidden = self.lm.embed(ids)
        for idx, weights in enumerate(self.lm.fused):
            hidden = self._layer(idx, weights, hidden, rope, plan)
        return self.lm.logits(hidden)
