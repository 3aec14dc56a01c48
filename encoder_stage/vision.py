"""The vision tower: uint8 pixels in, visual feature rows out.

Loads only the vision weights of the checkpoint into the transformers vision
class of its family. Each visual token gets ``spec.feature_sets`` rows: the merged
embedding, then (Qwen3-VL) one row per deepstack layer, stacked as one tensor
(tokens, feature_sets, hidden) so that a token range of every set is one slice.
Normalisation and patchify run here, with the checkpoint's own image/video
processor arithmetic, on the device the tower runs on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoImageProcessor, AutoVideoProcessor
from transformers.initialization import no_init_weights

from mmcache.encoder_stage import tower_kernels, vision_attention, vision_rotary
from mmcache.shared import cpu_kernels
from mmcache.shared.checkpoint import ModelSpec, load_weights, vision_weight_name
from mmcache.shared.family import load_class
from mmcache.shared.keys import Fingerprint, fingerprint
from mmcache.shared.linear import pack_linears
from mmcache.shared.torch_utils import bfloat16_products_pay, resolve_device, resolve_dtype

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class VisionInput:
    """One unit of encoding: an image, or one temporal patch of a video."""

    modality: str  # "image" | "video"
    pixels: torch.Tensor  # uint8 (frames, channels, height, width)


class LinearPatchEmbed(torch.nn.Module):
    """The patch embedding as a matmul: a Conv3d whose kernel equals its stride and covers the
    whole patch is one linear map per patch, and CPU conv3d kernels are ~3x slower than the
    matmul (results agree to float rounding; the tests bound the difference)."""

    def __init__(self, conv: torch.nn.Conv3d):
        super().__init__()
        self.patch_dim = conv.weight[0].numel()
        self.weight = torch.nn.Parameter(
            conv.weight.detach().reshape(conv.out_channels, -1), requires_grad=False
        )
        bias = conv.bias  # Qwen3-VL's patch embedding has one
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        flat = hidden_states.reshape(-1, self.patch_dim).to(self.weight.dtype)
        return torch.nn.functional.linear(flat, self.weight, self.bias)


class VisionTower:
    def __init__(self, spec: ModelSpec, device: str = "auto", dtype: str = "auto"):
        self.spec = spec
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device, spec.saved_dtype)
        # ``auto`` on a CPU whose bfloat16 products are the slower (Intel's without AMX; a 448² image
        # on `mid` there took 553-625 ms in float32, 806-821 in bfloat16): the tower computes in
        # float32 and its features leave in bfloat16, the rounding an LLM stage on ``auto`` makes
        self.features_dtype = self.dtype
        cpu_bf16 = self.dtype == torch.bfloat16 and self.device.type == "cpu"
        if dtype == "auto" and cpu_bf16 and not bfloat16_products_pay():
            self.dtype = torch.float32
        config = AutoConfig.from_pretrained(spec.path).vision_config
        # attention through the compiled kernel where it takes the shapes, or SDPA (vision_attention)
        self.attention = vision_attention.implementation(self.device)
        config._attn_implementation = self.attention
        with no_init_weights():
            model = load_class(spec.family.vision_class)._from_config(config, dtype=self.dtype)
        state = load_weights(spec.path, vision_weight_name)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"vision weights do not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")
        model.patch_embed = LinearPatchEmbed(model.patch_embed.proj)
        self.model = model.to(self.device).eval()
        # bfloat16 on a CPU: each linear's weight packed once for oneDNN (the same results, ~10%
        # less time for a 448² image on the mid checkpoint); elsewhere nothing changes.
        pack_linears(self.model)
        # bfloat16 or float32 on a CPU: the rotary embedding (the same bits) and the attention
        # through the compiled kernels.
        probe = torch.empty(0, dtype=self.dtype, device=self.device)
        self.kernels = cpu_kernels.usable(probe, dtypes=(torch.bfloat16, torch.float32))
        # NOTE: a family whose module has no rotary function keeps the compiled attention
        vision_rotary.install(spec.family.vision_class.split(":")[0])
        self.image_processor = AutoImageProcessor.from_pretrained(spec.path)
        self.video_processor = AutoVideoProcessor.from_pretrained(spec.path)
        self.merge = config.spatial_merge_size
        self.feature_sets = spec.feature_sets
        self.fingerprint: Fingerprint = fingerprint(
            "vision",
            [
                ("weights", spec.weights_fingerprint.hex()),
                ("dtype", str(self.dtype)),
                ("features", str(self.features_dtype)),
                ("attention", self.attention),  # the two round differently
            ],
        )

    def patches(self, chunk: VisionInput) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Normalise and patchify one chunk exactly as the HF processor does."""
        proc = self.image_processor if chunk.modality == "image" else self.video_processor
        pixels = chunk.pixels.to(self.device)
        # images: (1, C, H, W); video chunks: (1, T, C, H, W)
        pixels = pixels[0][None] if chunk.modality == "image" else pixels[None]
        normed = proc.rescale_and_normalize(
            pixels, proc.do_rescale, proc.rescale_factor, proc.do_normalize, proc.image_mean, proc.image_std
        )
        out = proc.patchify(
            normed,
            patch_size=proc.patch_size,
            merge_size=proc.merge_size,
            temporal_patch_size=proc.temporal_patch_size,
        )
        flat, grid = out[0], out[1:]
        grid_thw = (1, *grid) if len(grid) == 2 else tuple(grid)
        return flat[0], grid_thw

    @torch.inference_mode()
    def encode(self, chunks: list[VisionInput]) -> list[torch.Tensor]:
        """One forward over all chunks; returns (tokens, feature_sets, hidden) rows per chunk, on the CPU."""
        prepared = [self.patches(c) for c in chunks]
        # one chunk (a lone image, the usual case): its patches as they are, not copied by a cat
        patches = [p for p, _ in prepared]
        pixel_values = (patches[0] if len(patches) == 1 else torch.cat(patches)).to(self.dtype)
        grid_thw = torch.tensor([g for _, g in prepared], dtype=torch.long, device=self.device)
        with tower_kernels.active(self.kernels):
            out = self.model(pixel_values, grid_thw=grid_thw)
        sets = [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]
        if len(sets) != self.feature_sets:
            raise RuntimeError(f"vision tower returned {len(sets)} feature sets, want {self.feature_sets}")
        rows = sets[0][:, None] if len(sets) == 1 else torch.stack(sets, dim=1)  # a view when one set
        sizes = (grid_thw.prod(-1) // (self.merge * self.merge)).tolist()
        return [e.to("cpu", dtype=self.features_dtype, copy=True) for e in torch.split(rows, sizes)]

    def num_patches(self, chunk: VisionInput) -> int:
        _, _, h, w = chunk.pixels.shape
        patch = self.image_processor.patch_size
        return (h // patch) * (w // patch)
