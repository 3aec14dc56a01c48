"""The language model of a checkpoint, text weights only.

The transformers text-model class of the family loads the weights and provides
the M-RoPE tables (interleaved for Qwen3-VL); :mod:`llm_stage.model_runner` drives
the layers over the paged KV cache through :class:`LayerWeights`, which fuse q/k/v
and gate/up into one matrix each (the modules' own parameters become views of
those, so nothing is stored twice). The family's text block decides the rest:
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

from mmcache.shared.checkpoint import ModelSpec, load_weights, text_weight_name
from mmcache.shared.family import load_class


@dataclass(frozen=True, slots=True)
class LayerWeights:
    qkv: torch.Tensor  # (q + k + v outputs, hidden)
    qkv_bias: torch.Tensor | None  # Qwen2 layers
    o: torch.Tensor
    gate_up: torch.Tensor | None  # (2 * intermediate, hidden); None in a mixture-of-experts layer
    down: torch.Tensor | None
    act: Callable[[torch.Tensor], torch.Tensor] | None
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    norm_shape: tuple[int]
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


def _fuse(linears: list[nn.Linear], name: str) -> torch.Tensor:
    """One tensor holding ``name`` (weight or bias) of every linear, stacked along the outputs;
    each linear's own parameter becomes a view into it."""
    fused = torch.cat([getattr(lin, name).detach() for lin in linears])
    start = 0
    for lin in linears:
        end = start + getattr(lin, name).shape[0]
        setattr(lin, name, nn.Parameter(fused[start:end], requires_grad=False))
        start = end
    return fused


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
    return LayerWeights(
        qkv=_fuse(qkv, "weight"),
        qkv_bias=_fuse(qkv, "bias") if attn.q_proj.bias is not None else None,
        o=attn.o_proj.weight,
        gate_up=None if moe else _fuse([mlp.gate_proj, mlp.up_proj], "weight"),
        down=None if moe else mlp.down_proj.weight,
        act=None if moe else mlp.act_fn,
        input_norm=norm.weight,
        post_norm=layer.post_attention_layernorm.weight,
        norm_shape=(norm.weight.shape[0],),
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

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(token_ids)

    def rope(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for M-RoPE positions shaped (3, tokens); returned as (1, tokens, head_dim)."""
        return self.model.rotary_emb(hidden[None], positions[:, None, :])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        norm = self.model.norm
        return self.lm_head(F.rms_norm(hidden, norm.weight.shape, norm.weight, norm.variance_epsilon)).float()
