"""Checkpoint sizes for ``make-tiny-model --preset``: the same families and tokenizer, other dimensions.

``tiny`` (the default) is the 1.3 M-parameter test model, where overheads dominate. ``mid`` has
Qwen2-0.5B's text shape (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864) and an 8-block,
width-640 vision tower (~410 M parameters): compute matters there as it does for a served model.
``2b`` has the real dimensions of the family's ~2 B model (Qwen2-VL-2B; Qwen3-VL-2B for the Qwen3
families). ``mid`` and ``2b`` are saved in bfloat16 as the real checkpoints are (so ``--dtype auto``
serves them in bfloat16 where the machine computes in it); ``tiny`` in float32. Every preset keeps
the tiny tokenizer, so the vocabulary (and the LM head) stays small: a real model's 151 k-row head
is not part of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PRESETS = ("tiny", "mid", "2b")


@dataclass(frozen=True, slots=True)
class Preset:
    text: dict[str, Any]  # overrides of the text config (hidden size, layers, heads, ...)
    head_dim: int
    vision_depth: int
    vision_width: int
    vision_heads: int
    vision_mlp: int  # the vision MLP's inner width
    dtype: str = "float32"  # saved as; `mid` and `2b` in bfloat16, as the real checkpoints are
    initializer_range: float = 0.1  # well above the 0.02 default so a tiny model reacts visibly
    tie_word_embeddings: bool = False
    # Qwen3 families only, when they differ from the Qwen2 ones (a different real 2 B model).
    qwen3_text: dict[str, Any] = field(default_factory=dict)
    qwen3_vision: dict[str, Any] = field(default_factory=dict)
    moe_intermediate: int = 256  # each expert's MLP width (Qwen3-VL-MoE: 8 experts, 2 per token)

    def mrope_section(self, qwen3: bool) -> list[int]:
        """The three M-RoPE sections (time, height, width) of half a head, split as the families do."""
        half = self.qwen3_text.get("head_dim", self.head_dim) // 2 if qwen3 else self.head_dim // 2
        if qwen3:  # Qwen3-VL: 24 / 20 / 20 of 64
            hw = half * 5 // 16
            return [half - 2 * hw, hw, hw]
        t = half // 4  # Qwen2-VL: 16 / 24 / 24 of 64
        return [t, (half - t) // 2, half - t - (half - t) // 2]


_PRESETS = {
    "tiny": Preset(
        text={
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
        head_dim=32,
        vision_depth=2,
        vision_width=64,
        vision_heads=4,
        vision_mlp=128,
        # Three deepstack layers, as in the real models (there: 8, 16 and 24 of 27).
        qwen3_vision={"depth": 3, "deepstack_visual_indexes": [0, 1, 2], "num_position_embeddings": 64},
    ),
    "mid": Preset(
        text={
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
        },
        head_dim=64,
        vision_depth=8,
        vision_width=640,
        vision_heads=10,
        vision_mlp=2560,
        dtype="bfloat16",
        initializer_range=0.02,
        moe_intermediate=608,  # 8 experts of 608: the dense MLP's weights, split
    ),
    "2b": Preset(
        text={
            "hidden_size": 1536,
            "intermediate_size": 8960,
            "num_hidden_layers": 28,
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
        },
        head_dim=128,
        vision_depth=32,
        vision_width=1280,
        vision_heads=16,
        vision_mlp=5120,
        dtype="bfloat16",
        initializer_range=0.02,
        tie_word_embeddings=True,
        qwen3_text={
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
        },
        qwen3_vision={"depth": 24, "hidden_size": 1024, "num_heads": 16, "intermediate_size": 4096},
        moe_intermediate=768,  # Qwen3-VL-30B-A3B's expert width
    ),
}


def check_preset(preset: str) -> None:
    if preset not in _PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {PRESETS}")


def preset(name: str) -> Preset:
    check_preset(name)
    return _PRESETS[name]
