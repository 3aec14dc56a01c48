"""The language model of a Qwen2-VL-family checkpoint, text weights only.

The transformers text-model class loads the weights and provides the M-RoPE
tables; :mod:`llm_stage.model_runner` drives the layers over the paged KV cache
through :class:`LayerWeights`, which fuse q/k/v and gate/up into one matrix each
(the modules' own parameters become views of those, so nothing is stored twice).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig
from transformers.initialization import no_init_weights

from shared.checkpoint import ModelSpec, load_weights, text_weight_name


@dataclass(frozen=True, slots=True)
class LayerWeights:
    qkv: torch.Tensor  # (q + k + v outputs, hidden)
    qkv_bias: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor  # (2 * intermediate, hidden)
    down: torch.Tensor
    act: Callable[[torch.Tensor], torch.Tensor]
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    norm_shape: tuple[int]
    eps: float


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


def _layer_weights(layer: nn.Module) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
    norm = layer.input_layernorm
    return LayerWeights(
        qkv=_fuse(qkv, "weight"),
        qkv_bias=_fuse(qkv, "bias"),
        o=attn.o_proj.weight,
        gate_up=_fuse([mlp.gate_proj, mlp.up_proj], "weight"),
        down=mlp.down_proj.weight,
        act=mlp.act_fn,
        input_norm=norm.weight,
        post_norm=layer.post_attention_layernorm.weight,
        norm_shape=(norm.weight.shape[0],),
        eps=norm.variance_epsilon,
    )


def _text_class(model_type: str) -> type:
    if model_type == "qwen2_vl":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLTextModel

        return Qwen2VLTextModel
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLTextModel

    return Qwen2_5_VLTextModel


class TextLM(nn.Module):
    """Decoder stack plus ``lm_head``; only the language-model tensors are read from disk."""

    def __init__(self, spec: ModelSpec, device: torch.device, dtype: torch.dtype):
        super().__init__()
        full = AutoConfig.from_pretrained(spec.path)
        config = full.text_config
        config._attn_implementation = "sdpa"
        with no_init_weights():
            self.model = _text_class(spec.model_type)._from_config(config, dtype=dtype)
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
        self.num_heads = attn.num_heads
        self.num_kv_heads = attn.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.vocab_size = config.vocab_size
        if attn.o_proj.bias is not None or any(lin.bias is None for lin in (attn.q_proj, attn.k_proj)):
            raise ValueError("expected q/k/v projections with bias and o_proj without (the Qwen2 layout)")
        with torch.no_grad():
            self.fused = [_layer_weights(layer) for layer in self.layers]

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
