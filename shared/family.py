"""The model families mmcache serves, as data: what differs between them, in one place.

Every stage looks up the family of its checkpoint (``config.json``'s ``model_type``) here
instead of branching on names, so a new family is one more entry (plus its classes, if
transformers names them differently):

- *vision outputs*: how many feature sets the vision tower returns per visual token (the
  merged embedding, then one per deepstack layer); the language model adds deepstack set
  ``i`` to the hidden states of the visual tokens after its decoder layer ``i``.
- *position rule*: M-RoPE over (t, h, w); Qwen2.5-VL spaces video chunks by time
  (``tokens_per_second``), the others by chunk index; Qwen3-VL interleaves the three axes
  over the rotary frequencies (inside the transformers rotary class, which we reuse).
- *placeholder layout*: a video is one run of placeholder tokens (Qwen2-VL, Qwen2.5-VL), or
  one run per temporal chunk, each preceded by its timestamp text (Qwen3-VL).
- *text-model block*: Qwen2 layers (q/k/v biases) or Qwen3 layers (no biases, RMS norm of q
  and k over the head dimension before the rotary embedding); Qwen3-VL-MoE's layers route each
  token to a few experts instead of one MLP (the layer's own transformers module runs them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ModelFamily:
    model_type: str  # config.json's model_type
    arch: str  # the name users type (``make-tiny-model --arch``)
    vision_class: str  # "module:Class" of the vision tower in transformers
    text_class: str  # "module:Class" of the decoder stack in transformers
    deepstack: bool  # the vision tower returns deepstack feature sets (config: deepstack_visual_indexes)
    time_spaced_video: bool  # video chunk t positions are int(i * tokens_per_second * seconds_per_chunk)
    timestamped_video: bool  # each video chunk is its own placeholder run after "<t seconds>" text
    qk_norm: bool  # text layers normalise q and k per head (Qwen3); else q/k/v carry biases (Qwen2)


_T = "transformers.models."

FAMILIES: dict[str, ModelFamily] = {
    f.model_type: f
    for f in (
        ModelFamily(
            model_type="qwen2_vl",
            arch="qwen2-vl",
            vision_class=_T + "qwen2_vl.modeling_qwen2_vl:Qwen2VisionTransformerPretrainedModel",
            text_class=_T + "qwen2_vl.modeling_qwen2_vl:Qwen2VLTextModel",
            deepstack=False,
            time_spaced_video=False,
            timestamped_video=False,
            qk_norm=False,
        ),
        ModelFamily(
            model_type="qwen2_5_vl",
            arch="qwen2.5-vl",
            vision_class=_T + "qwen2_5_vl.modeling_qwen2_5_vl:Qwen2_5_VisionTransformerPretrainedModel",
            text_class=_T + "qwen2_5_vl.modeling_qwen2_5_vl:Qwen2_5_VLTextModel",
            deepstack=False,
            time_spaced_video=True,
            timestamped_video=False,
            qk_norm=False,
        ),
        ModelFamily(
            model_type="qwen3_vl",
            arch="qwen3-vl",
            vision_class=_T + "qwen3_vl.modeling_qwen3_vl:Qwen3VLVisionModel",
            text_class=_T + "qwen3_vl.modeling_qwen3_vl:Qwen3VLTextModel",
            deepstack=True,
            time_spaced_video=False,
            timestamped_video=True,
            qk_norm=True,
        ),
        ModelFamily(
            model_type="qwen3_vl_moe",
            arch="qwen3-vl-moe",
            vision_class=_T + "qwen3_vl_moe.modeling_qwen3_vl_moe:Qwen3VLMoeVisionModel",
            text_class=_T + "qwen3_vl_moe.modeling_qwen3_vl_moe:Qwen3VLMoeTextModel",
            deepstack=True,
            time_spaced_video=False,
            timestamped_video=True,
            qk_norm=True,
        ),
    )
}


def load_class(path: str) -> Any:
    """The class named ``module:Class`` (imported only by the stage that needs it; Any: a
    transformers class, whose class methods such as ``_from_config`` are not typed)."""
    import importlib

    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def video_timestamps(num_frames: int, fps: float, temporal_patch_size: int) -> list[float]:
    """Seconds shown before each temporal chunk of a Qwen3-VL video: the mean time of the chunk's
    first and last frame, the last chunk padded with its last frame (the reference arithmetic,
    so the text formats identically)."""
    indices = list(range(num_frames))
    if pad := -num_frames % temporal_patch_size:
        indices += [indices[-1]] * pad
    times = [i / fps for i in indices]
    return [
        (times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)
    ]


def timestamp_text(seconds: float) -> str:
    return f"<{seconds:.1f} seconds>"
