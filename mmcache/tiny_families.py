"""What differs between the tiny model families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL dense and MoE):
chat templates, model configs and classes, and image/video processors."""

from __future__ import annotations

from typing import Any

from mmcache.tiny_presets import preset
from mmcache.tiny_tokenizer import SPECIAL_TOKENS, build_tokenizer

TINY_MODEL_ARCHS = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3-vl-moe")

CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    # Tools as Qwen2.5 lists them: in the system turn, one JSON signature a line.
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' and messages[0]['content'] is string %}"
    "{{ messages[0]['content'] }}"
    "{% else %}You are a helpful assistant.{% endif %}{{ '\\n\\n' }}# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n{% endif %}'
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' and message['content'] is string %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}"
    "{% if loop.first and message['role'] != 'system' and not tools %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% for tool_call in message['tool_calls'] or [] %}"
    "{% set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}"
    "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": "{{ call[\'name\'] }}", '
    "\"arguments\": {{ call['arguments'] | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen3-VL's template: the same content rendering, but no default system message.
_DEFAULT_SYSTEM = (
    "{% if loop.first and message['role'] != 'system' and not tools %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}"
)
if _DEFAULT_SYSTEM not in CHAT_TEMPLATE:  # an edit to the template must keep this part findable
    raise RuntimeError("CHAT_TEMPLATE lost its default system turn")
QWEN3_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(_DEFAULT_SYSTEM, "")

_MIN_PIXELS = 56 * 56
_MAX_IMAGE_PIXELS = 448 * 448
_MAX_VIDEO_PIXELS = 224 * 224


def check_arch(arch: str) -> None:
    if arch not in TINY_MODEL_ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {TINY_MODEL_ARCHS}")


def model_config(arch: str, tokenizer: Any, size: str = "tiny") -> Any:
    """The model config (text and vision towers) of ``arch`` at preset ``size``, its token ids from
    ``tokenizer``."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig, Qwen3VLMoeConfig

    p = preset(size)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    text_config: dict[str, Any] = {
        "vocab_size": -(-len(tokenizer) // 64) * 64,
        **p.text,
        "max_position_embeddings": 8192,
        "max_window_layers": p.text["num_hidden_layers"],
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e6,
            "mrope_section": p.mrope_section(False),
        },
        "initializer_range": p.initializer_range,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "tie_word_embeddings": p.tie_word_embeddings,
        "dtype": p.dtype,
    }
    vision_common: dict[str, Any] = {
        "depth": p.vision_depth,
        "num_heads": p.vision_heads,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "initializer_range": p.initializer_range,
    }
    if arch == "qwen2-vl":
        config_cls: Any = Qwen2VLConfig
        vision_config = {
            **vision_common,
            "embed_dim": p.vision_width,
            "mlp_ratio": p.vision_mlp // p.vision_width,
            "hidden_size": p.text["hidden_size"],
        }
    elif arch == "qwen2.5-vl":
        config_cls = Qwen2_5_VLConfig
        depth = p.vision_depth
        vision_config = {
            **vision_common,
            "hidden_size": p.vision_width,
            "intermediate_size": p.vision_mlp,
            "out_hidden_size": p.text["hidden_size"],
            "window_size": 112,
            # Full attention in every 8th block, as in the real models (7, 15, 23, 31 of 32).
            "fullatt_block_indexes": list(range(7, depth, 8)) or [depth - 1],
            "tokens_per_second": 2,
        }
    else:
        config_cls = Qwen3VLConfig if arch == "qwen3-vl" else Qwen3VLMoeConfig
        text_config.update(p.qwen3_text)
        if arch == "qwen3-vl-moe":  # every layer routes each token to 2 of 8 experts
            text_config.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=p.moe_intermediate)
        # Qwen3 text layers: no q/k/v biases, q/k norms, an explicit head_dim, interleaved M-RoPE.
        del text_config["max_window_layers"]
        text_config.setdefault("head_dim", p.head_dim)
        text_config["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 5e6,
            "mrope_section": p.mrope_section(True),
            "mrope_interleaved": True,
        }
        depth = p.qwen3_vision.get("depth", p.vision_depth)
        vision_config = {
            **vision_common,
            "patch_size": 16,
            "hidden_size": p.vision_width,
            "intermediate_size": p.vision_mlp,
            "out_hidden_size": text_config["hidden_size"],
            "num_position_embeddings": 2304,
            # Three deepstack layers, as in the real models (8, 16 and 24 of 27; 5, 11, 17 of 24).
            "deepstack_visual_indexes": [depth * k // 4 - 1 for k in (1, 2, 3)],
            **p.qwen3_vision,
        }
    return config_cls(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=p.tie_word_embeddings,
        dtype=p.dtype,
    )


def model_class(arch: str) -> Any:
    """The transformers class that builds ``arch``'s model."""
    from transformers import (
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLForConditionalGeneration,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeForConditionalGeneration,
    )

    return {
        "qwen2-vl": Qwen2VLForConditionalGeneration,
        "qwen2.5-vl": Qwen2_5_VLForConditionalGeneration,
        "qwen3-vl": Qwen3VLForConditionalGeneration,
        "qwen3-vl-moe": Qwen3VLMoeForConditionalGeneration,
    }[arch]


def build_processor(arch: str = "qwen2-vl") -> Any:
    """The processor (tokenizer + image/video processors + chat template) for ``arch``."""
    from transformers import (
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    check_arch(arch)
    if arch.startswith("qwen3-vl"):
        # Qwen3-VL: 16-pixel patches, and a video budget over all frames together (up to 64 frames of
        # 224x224 fit, so the tiny model's frame size does not depend on the clip length there).
        vision: dict[str, Any] = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2}
        half = [0.5, 0.5, 0.5]  # the real Qwen3-VL processors normalise with mean = std = 0.5
        image_processor = Qwen2VLImageProcessor(
            min_pixels=64 * 64, max_pixels=_MAX_IMAGE_PIXELS, image_mean=half, image_std=half, **vision
        )
        video_processor: Any = Qwen3VLVideoProcessor(
            size={"shortest_edge": 2 * 64 * 64, "longest_edge": 64 * _MAX_VIDEO_PIXELS},
            cap_pixels_per_frame=False,
            **vision,
        )
        return Qwen3VLProcessor(
            image_processor=image_processor,
            tokenizer=build_tokenizer(),
            video_processor=video_processor,
            chat_template=QWEN3_CHAT_TEMPLATE,
        )
    vision = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}
    image_processor = Qwen2VLImageProcessor(min_pixels=_MIN_PIXELS, max_pixels=_MAX_IMAGE_PIXELS, **vision)
    video_processor = Qwen2VLVideoProcessor(
        min_pixels=_MIN_PIXELS, max_pixels=_MAX_VIDEO_PIXELS, cap_pixels_per_frame=False, **vision
    )
    processor_cls: Any = Qwen2VLProcessor if arch == "qwen2-vl" else Qwen2_5_VLProcessor
    return processor_cls(
        image_processor=image_processor,
        tokenizer=build_tokenizer(),
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )
