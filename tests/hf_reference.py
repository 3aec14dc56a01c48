"""Reference greedy generation with plain transformers (the same checkpoint, in-process).

mmcache must produce exactly these tokens under greedy decoding: the Auto classes are
the ground truth the pipeline (three processes, caches, paged KV) is compared against.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

VIDEO_FPS = 2.0  # the test videos are 2 fps and mmcache samples at 2 fps: every frame


def reference_device() -> torch.device:
    """Where the exactness suites run the reference and the engine: ``MMCACHE_TEST_DEVICE``
    (``cpu`` when unset; ``cuda`` on a GPU machine, as scripts/gpu-check does). Both run float32."""
    return torch.device(os.environ.get("MMCACHE_TEST_DEVICE", "cpu"))


@dataclass(frozen=True)
class HFResult:
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated, eos included when produced


@cache
def load(model_dir: str) -> tuple[Any, Any]:
    """(processor, model) for a checkpoint directory, loaded once per test session."""
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    return processor, model.to(reference_device())


def as_image(image: Image.Image | bytes) -> Image.Image:
    """A PIL image as decoded from its file; the HF processor does its own RGB conversion."""
    if isinstance(image, Image.Image):
        return image
    out = Image.open(io.BytesIO(image))
    out.load()
    return out


def hf_inputs(
    model_dir: str | Path,
    messages: list[dict],
    images: list[Image.Image | bytes] | None = None,
    videos: list[list[np.ndarray]] | None = None,
) -> Any:
    """The HF processor's model inputs for chat ``messages`` in HF form.

    Content parts are ``{"type": "text", "text": ...}``, ``{"type": "image"}`` and
    ``{"type": "video"}``; ``images`` and ``videos`` supply the media in order of appearance.
    A video is its list of decoded frames (already sampled: ``do_sample_frames=False``).
    """
    processor, _ = load(str(model_dir))
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    kwargs: dict[str, Any] = {}
    if videos:
        kwargs["videos"] = [list(v) for v in videos]
        # Qwen3-VL's prompt shows each chunk's time, computed from the frame indices.
        kwargs["video_metadata"] = [
            {"total_num_frames": len(v), "fps": VIDEO_FPS, "frames_indices": list(range(len(v)))}
            for v in videos
        ]
        kwargs["do_sample_frames"] = False
    return processor(
        text=[text],
        images=[as_image(i) for i in images] if images else None,
        return_tensors="pt",
        **kwargs,
    ).to(reference_device())


def hf_generate(
    model_dir: str | Path,
    messages: list[dict],
    images: list[Image.Image | bytes] | None = None,
    videos: list[list[np.ndarray]] | None = None,
    max_new_tokens: int = 16,
) -> HFResult:
    _, model = load(str(model_dir))
    inputs = hf_inputs(model_dir, messages, images, videos)
    prompt_len = inputs["input_ids"].shape[1]
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return HFResult(inputs["input_ids"][0].tolist(), out[0, prompt_len:].tolist())


def hf_greedy(
    model_dir: str | Path,
    messages: list[dict],
    images: list[Image.Image | bytes] | None = None,
    videos: list[list[np.ndarray]] | None = None,
    max_new_tokens: int = 16,
) -> list[int]:
    """Greedy new token ids (eos included when produced) from the HF model."""
    return hf_generate(model_dir, messages, images, videos, max_new_tokens).token_ids


def hf_greedy_logprobs(
    model_dir: str | Path,
    messages: list[dict],
    images: list[Image.Image | bytes] | None = None,
    videos: list[list[np.ndarray]] | None = None,
    max_new_tokens: int = 8,
) -> tuple[list[int], torch.Tensor]:
    """Greedy new token ids and the log-softmax of HF's scores at each step, (steps, vocab)."""
    _, model = load(str(model_dir))
    inputs = hf_inputs(model_dir, messages, images, videos)
    prompt_len = inputs["input_ids"].shape[1]
    with torch.inference_mode():
        out = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    scores = torch.stack(out.scores)[:, 0].float().cpu()
    return out.sequences[0, prompt_len:].tolist(), torch.log_softmax(scores, dim=-1)


def hf_prompt_logprobs(
    model_dir: str | Path,
    messages: list[dict],
    images: list[Image.Image | bytes] | None = None,
    videos: list[list[np.ndarray]] | None = None,
) -> tuple[list[int], torch.Tensor]:
    """Prompt token ids and the log-softmax of HF's logits over the prompt: row ``j`` is the
    distribution of token ``j + 1``, (prompt tokens - 1, vocab)."""
    _, model = load(str(model_dir))
    inputs = hf_inputs(model_dir, messages, images, videos)
    with torch.inference_mode():
        logits = model(**inputs).logits[0, :-1].float().cpu()
    return inputs["input_ids"][0].tolist(), torch.log_softmax(logits, dim=-1)
