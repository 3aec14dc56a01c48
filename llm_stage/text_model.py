"""The language model of a Qwen2-VL-family checkpoint, text weights only.

The transformers text-model class holds the weights and provides the layers'
modules (projections, norms, MLP, M-RoPE tables); :mod:`llm_stage.model_runner`
drives them over the paged KV cache.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig
from transformers.initialization import no_init_weights

from shared.checkpoint import ModelSpec, load_weights, text_weight_name


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

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(token_ids)

    def rope(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for M-RoPE positions shaped (3, tokens); returned as (1, tokens, head_dim)."""
        return self.model.rotary_emb(hidden[None], positions[:, None, :])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden)).float()
