"""VisionTower (vision weights only) against the full HF model's visual features, every arch.

Every feature set is compared: the merged embeddings and, for Qwen3-VL, each deepstack set.
"""

from __future__ import annotations

import functools
import io
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from mmcache.encoder_stage.vision import VisionInput, VisionTower
from mmcache.processor.media_decode import DecodedVideo
from mmcache.processor.preprocess import Preprocessor
from mmcache.shared.checkpoint import ModelSpec
from tests.media import decode_all_frames, image_bytes, video_bytes

ARCHS = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3-vl-moe")
# float32 summed in other orders than HF's (chunk by chunk, the compiled attention, MKL's kernels at
# another row count): up to 1.0e-5 apart on outputs of magnitude ~3 on an Intel Xeon with AVX512F
# (MKL's float32 kernels there differ from an AMD EPYC's, where the gap is smaller).
TOL = 2e-5


@dataclass
class Env:
    arch: str
    hf_processor: object
    hf_model: object
    pre: Preprocessor
    tower: VisionTower


@pytest.fixture(scope="module", params=ARCHS)
def env(request, tiny_models) -> Env:
    path = tiny_models[request.param]
    return Env(
        request.param,
        AutoProcessor.from_pretrained(path),
        AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval(),
        Preprocessor(str(path), video_fps=2.0, max_video_frames=64),
        VisionTower(ModelSpec.load(path), device="cpu", dtype="float32"),
    )


@functools.cache
def _video(n: int, width: int, height: int, seed: int = 0) -> np.ndarray:
    return np.stack(decode_all_frames(video_bytes(num_frames=n, width=width, height=height, seed=seed)))


@functools.cache
def _image_data(width: int, height: int, seed: int) -> bytes:
    return image_bytes(width, height, seed=seed)


def _image(width: int, height: int, seed: int = 0) -> Image.Image:
    return Image.open(io.BytesIO(_image_data(width, height, seed)))


def _video_chunks(env: Env, frames: np.ndarray) -> list[VisionInput]:
    layout = env.pre.video(DecodedVideo(frames, 2.0), salt=None)
    return [VisionInput("video", c.pixels) for c in layout.chunks]


def _image_chunk(env: Env, image: Image.Image) -> VisionInput:
    return VisionInput("image", env.pre.image(image, salt=None).chunks[0].pixels)


def _hf_rows(out, index: int = 0) -> torch.Tensor:
    """HF's features of item ``index`` as (tokens, feature sets, hidden), like the tower's rows."""
    sets = [out.pooler_output[index], *(f[index] for f in getattr(out, "deepstack_features", None) or [])]
    return torch.stack(sets, dim=1)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


def test_tower_holds_only_vision_weights(env: Env):
    names = [n for n, _ in env.tower.model.named_parameters()]
    assert names and not any("language_model" in n or "lm_head" in n or "embed_tokens" in n for n in names)
    hf_visual = dict(env.hf_model.model.visual.named_parameters())
    # The patch embedding runs as a matmul: HF's Conv3d kernel, flattened.
    hf_visual["patch_embed.weight"] = hf_visual.pop("patch_embed.proj.weight").flatten(1)
    if "patch_embed.proj.bias" in hf_visual:  # Qwen3-VL
        hf_visual["patch_embed.bias"] = hf_visual.pop("patch_embed.proj.bias")
    assert set(names) == set(hf_visual)
    for name, param in env.tower.model.named_parameters():
        assert torch.equal(param, hf_visual[name]), name


@pytest.mark.parametrize("shape", [(4, 224, 224), (6, 320, 180)])
def test_video_chunk_by_chunk_equals_hf_whole_video(env: Env, shape):
    frames = _video(*shape)
    chunks = _video_chunks(env, frames)
    ours = torch.cat([env.tower.encode([chunk])[0] for chunk in chunks])

    ref_in = env.hf_processor.video_processor(videos=[frames], do_sample_frames=False, return_tensors="pt")
    with torch.no_grad():
        ref = _hf_rows(
            env.hf_model.model.get_video_features(ref_in["pixel_values_videos"], ref_in["video_grid_thw"])
        )
    assert ours.dtype == torch.float32 and ours.device.type == "cpu"
    assert _max_diff(ours, ref) <= TOL


@pytest.mark.parametrize("size", [(448, 448), (300, 200), (1000, 120), (57, 57)])
def test_image_encode_equals_hf_image_features(env: Env, size):
    image = _image(*size)
    (ours,) = env.tower.encode([_image_chunk(env, image)])
    ref_in = env.hf_processor.image_processor(images=[image], return_tensors="pt")
    with torch.no_grad():
        ref = _hf_rows(
            env.hf_model.model.get_image_features(ref_in["pixel_values"], ref_in["image_grid_thw"])
        )
    t, h, w = ref_in["image_grid_thw"][0].tolist()
    sets = 4 if env.arch.startswith("qwen3-vl") else 1  # merged + 3 deepstack layers
    assert ours.shape == (t * h * w // 4, sets, env.hf_model.config.text_config.hidden_size)
    assert _max_diff(ours, ref) <= TOL


def test_batch_of_chunks_equals_one_by_one(env: Env):
    chunks = [
        *_video_chunks(env, _video(6, 320, 180)),
        _image_chunk(env, _image(300, 200, seed=1)),
        *_video_chunks(env, _video(4, 224, 224, seed=2)),
        _image_chunk(env, _image(57, 57, seed=3)),
        _image_chunk(env, _image(1000, 120, seed=4)),
    ]
    single = [env.tower.encode([c])[0] for c in chunks]
    batched = env.tower.encode(chunks)
    assert len(batched) == len(chunks)
    for one, many in zip(single, batched, strict=True):
        assert _max_diff(many, one) <= TOL
    # batch order matters: reversing the batch reverses the outputs
    reversed_out = env.tower.encode(chunks[::-1])
    for one, many in zip(single[::-1], reversed_out, strict=True):
        assert _max_diff(many, one) <= TOL


def test_chunks_of_one_video_are_independent(env: Env):
    """A temporal patch's embedding does not depend on the frames around it (what makes per-chunk
    caching exact): the first two chunks of a longer clip equal those of its 4-frame prefix."""
    short = _video_chunks(env, _video(4, 224, 224))
    long = _video_chunks(env, _video(8, 224, 224))
    for a, b in zip(env.tower.encode(short), env.tower.encode(long)[:2], strict=True):
        assert _max_diff(a, b) <= TOL


def test_output_rows_and_num_patches(env: Env):
    chunk = _image_chunk(env, _image(300, 200))
    flat, grid = env.tower.patches(chunk)
    # 300x200 on a grid of 28 pixels (14-pixel patches, merged 2x2), of 32 for Qwen3-VL
    patch, h, w = (16, 12, 18) if env.arch.startswith("qwen3-vl") else (14, 14, 22)
    assert grid == (1, h, w)
    assert flat.shape == (h * w, 3 * 2 * patch * patch)
    assert env.tower.num_patches(chunk) == h * w
    (emb,) = env.tower.encode([chunk])
    assert emb.shape[:2] == (h * w // 4, env.tower.feature_sets)


def test_fingerprint_depends_on_dtype(env: Env, tiny_models):
    spec = ModelSpec.load(tiny_models[env.arch])
    again = VisionTower(spec, device="cpu", dtype="float32")
    assert again.fingerprint == env.tower.fingerprint
    bf16 = VisionTower(spec, device="cpu", dtype="bfloat16")
    assert bf16.fingerprint != env.tower.fingerprint
    assert bf16.encode([_image_chunk(env, _image(57, 57))])[0].dtype == torch.bfloat16
