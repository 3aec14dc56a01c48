"""The language model of a checkpoint, text weights only.

The transformers text-model class of the family loads the weights and provides
the M-RoPE tables (interleaved for Qwen3-VL); :mod:`llm_stage.model_runner` drives
the layers over the paged KV cache through :class:`LayerWeights`, which fuse q/k/v
and gate/up into one :class:`~shared.linear.Projection` each. A projection whose
weight got packed for the CPU's kernel holds the only copy: the module's own linear
is emptied, so nothing is stored twice. The family's text block decides the rest:
Qwen2 layers carry q/k/v biases, Qwen3 layers normalise q and k per head instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig
from transformers.initialization import no_init_weights

from mmcache.shared import cpu_kernels
from mmcache.shared.checkpoint import ModelSpec, load_weights, text_weight_name
from mmcache.shared.family import load_class
from mmcache.shared.linear import Projection


@dataclass(frozen=True, slots=True)
class LayerWeights:
    qkv: Projection  # hidden -> q + k + v outputs (with biases in Qwen2 layers)
    o: Projection
    gate_up: Projection | None  # hidden -> 2 * intermediate; None in a mixture-of-experts layer
    down: Projection | None
    act: Callable[[torch.Tensor], torch.Tensor] | None
    # The norms' weights carry the input scale of the projection they feed (folded in, exact:
    # :meth:`~mmcache.shared.linear.Projection.prescaled`), so the layer calls ``prescaled``.
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    # Qwen3 layers: norm weights of each query head, then each kv head: (heads + kv_heads, head_dim)
    qk_norm: torch.Tensor | None = None
    qk_eps: float = 0.0
    moe: nn.Module | None = None  # Qwen3-VL-MoE: the layer's experts block, (1, rows, hidden) in and out


def qk_norm_(qk: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """Qwen3's q/k norm in place on (rows, heads + kv_heads, head_dim): each head over its dimension.

    NOTE: ``rms_norm`` without a weight, then the weight, is the reference's order of operations
    (normalise, then scale): in float32 the result is the modules' bit for bit (a test checks).
    """
    normed = F.rms_norm(qk, (qk.shape[-1],), None, eps)
    qk.copy_(normed.mul_(weight))


def _project(linears: list[nn.Linear]) -> Projection:
    """One projection computing every linear of ``linears``, outputs stacked in order.

    The modules' weights end as views of the stacked one, or empty when the projection packed it.
    """
    weight = torch.cat([lin.weight.detach() for lin in linears])
    bias = torch.cat([lin.bias.detach() for lin in linears]) if linears[0].bias is not None else None
    proj = Projection(weight, bias)
    start = 0
    for lin in linears:
        end = start + lin.weight.shape[0]
        # NOTE: a packed projection holds the only copy: even an empty view would keep the dense
        # tensor's storage alive, so the module gets a fresh empty weight.
        kept = weight[start:end] if not proj.packed else weight.new_empty((0, weight.shape[1]))
        lin.weight = nn.Parameter(kept, requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[start:end], requires_grad=False)
        start = end
    return proj


def _scaled(norm: torch.Tensor, scale: float) -> torch.Tensor:
    return norm if scale == 1.0 else norm * scale


def _layer_weights(layer: Any, heads: int, kv_heads: int) -> LayerWeights:
    """``layer``: a transformers decoder layer (its submodules are named as in the family's)."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
    moe = hasattr(mlp, "experts")  # routed experts: their module runs them, nothing to fuse
    norm = layer.input_layernorm
    qk_norm, qk_eps = None, 0.0
    if hasattr(attn, "q_norm"):
        qk_norm = torch.cat([attn.q_norm.weight.expand(heads, -1), attn.k_norm.weight.expand(kv_heads, -1)])
        qk_eps = attn.q_norm.variance_epsilon
    qkv_proj = _project(qkv)
    gate_up = None if moe else _project([mlp.gate_proj, mlp.up_proj])
    return LayerWeights(
        qkv=qkv_proj,
        o=_project([attn.o_proj]),
        gate_up=gate_up,
        down=None if moe else _project([mlp.down_proj]),
        act=None if moe else mlp.act_fn,
        input_norm=_scaled(norm.weight, qkv_proj.input_scale),
        post_norm=_scaled(layer.post_attention_layernorm.weight, gate_up.input_scale if gate_up else 1.0),
        eps=norm.variance_epsilon,
        qk_norm=qk_norm,
        qk_eps=qk_eps,
        moe=mlp if moe else None,
    )


class TextLM(nn.Module):
    """Decoder stack plus ``lm_head``; only the language-model tensors are read from disk."""

    def __init__(self, spec: ModelSpec, device: torch.device, dtype: torch.dtype):
        super().__init__()
        full = AutoConfig.from_pretrained(spec.path)
        config = full.text_config
        config._attn_implementation = "sdpa"
        with no_init_weights():
            self.model = load_class(spec.family.text_class)._from_config(config, dtype=dtype)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        state = load_weights(spec.path, text_weight_name)
        tied = "lm_head.weight" not in state
        if tied:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        missing, unexpected = self.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"text weights do not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")
        self.config = config
        # NOTE: only move devices; a dtype cast would round the fp32 rotary table like HF never does.
        self.to(device=device).eval()
        attn = self.model.layers[0].self_attn
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.vocab_size = config.vocab_size
        biases = [lin.bias is not None for lin in (attn.q_proj, attn.k_proj, attn.v_proj)]
        has_norm = hasattr(attn, "q_norm")
        qwen3, qwen2 = has_norm and not any(biases), all(biases) and not has_norm
        if attn.o_proj.bias is not None or not (qwen3 if spec.family.qk_norm else qwen2):
            raise ValueError("unexpected attention layout: want q/k norms (Qwen3) or q/k/v biases (Qwen2)")
        with torch.no_grad():
            self.fused = [_layer_weights(layer, self.num_heads, self.num_kv_heads) for layer in self.layers]
            # NOTE: a tied head shares the embedding table, which lookups need dense: packing it
            # keeps a second copy (the price of reading it at the packed kernel's speed).
            self.head = Projection(self.lm_head.weight.detach())
            self.head_norm = _scaled(self.model.norm.weight, self.head.input_scale)
            if self.head.packed and not tied:
                empty = self.lm_head.weight.new_empty((0, config.hidden_size))
                self.lm_head.weight = nn.Parameter(empty, requires_grad=False)
        # NOTE: the head's norm compiled where the layers' are (model_runner): torch's wakes its
        # sleeping OpenMP threads for a row or two (~0.2 ms of a `mid` decode step on two threads).
        self.kernels = cpu_kernels.usable(self.head_norm, dtypes=(torch.bfloat16, torch.float32))

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(token_ids)

    def rope(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for M-RoPE positions shaped (3, tokens); returned as (1, tokens, head_dim)."""
        return self.model.rotary_emb(hidden[None], positions[:, None, :])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        eps = self.model.norm.variance_epsilon
        normed = cpu_kernels.rms_norm_or_eager(self.kernels, hidden, self.head_norm, eps)
        return self.head.prescaled(normed).float()

    def step_weight_bytes(self) -> int:
        """Bytes of weights a decode step reads: every projection, norm and expert, not the
        embedding table (a step reads one row of it)."""
        tensors = [self.model.norm.weight]
        for w in self.fused:
            tensors += [w.input_norm, w.post_norm] + ([w.qkv.bias] if w.qkv.bias is not None else [])
            tensors += list(w.moe.parameters()) if w.moe is not None else []
        return sum(p.nbytes for p in self._projections()) + sum(t.nbytes for t in tensors)

    def step_parameters(self) -> int:
        """Weights a token is multiplied with (the embedding table and norms excluded)."""
        experts = sum(p.numel() for w in self.fused if w.moe is not None for p in w.moe.parameters())
        return sum(p.numel for p in self._projections()) + experts

    def _projections(self) -> list[Projection]:
        out = [self.head]
        for w in self.fused:
            out += [p for p in (w.qkv, w.o, w.gate_up, w.down) if p is not None]
        return out
