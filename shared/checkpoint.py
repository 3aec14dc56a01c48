"""A checkpoint as the stages see it: its family (:mod:`shared.family`) and facts from its directory.

Each stage reads only what it needs: the encoder the vision weights, the LLM
stage the text weights; both via :func:`load_weights`, which opens the
safetensors files lazily and never materialises the other half.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open

from mmcache.shared.family import FAMILIES, ModelFamily
from mmcache.shared.keys import Fingerprint, fingerprint

ARCHS = {f.model_type: f.arch for f in FAMILIES.values()}


class CheckpointError(ValueError):
    """The directory is not a checkpoint of a family mmcache serves."""


@dataclass(frozen=True)
class ModelSpec:
    """What every stage must agree on about one checkpoint."""

    path: Path
    model_type: str  # a key of shared.family.FAMILIES
    config: dict
    eos_token_ids: tuple[int, ...]

    @classmethod
    def load(cls, path: str | os.PathLike) -> ModelSpec:
        root = Path(path)
        cfg_file = root / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(f"{root} has no config.json")
        config = json.loads(cfg_file.read_text())
        model_type = config.get("model_type")
        if model_type not in ARCHS:
            raise CheckpointError(f"model_type {model_type!r} is not one of {sorted(ARCHS)}")
        eos: list[int] = []
        gen_file = root / "generation_config.json"
        for source in (
            json.loads(gen_file.read_text()) if gen_file.is_file() else {},
            config,
            config.get("text_config", {}),
        ):
            value = source.get("eos_token_id")
            if value is not None and not eos:
                eos = [value] if isinstance(value, int) else list(value)
        return cls(root, model_type, config, tuple(eos))

    @property
    def text_config(self) -> dict:
        # NOTE: older checkpoints keep the text settings at the top level.
        return {**self.config, **self.config.get("text_config", {})}

    @property
    def family(self) -> ModelFamily:
        return FAMILIES[self.model_type]

    @property
    def saved_dtype(self) -> str:
        """The dtype the weights were saved in (config ``dtype``, older ``torch_dtype``), or ""."""
        for source in (self.config, self.config.get("text_config", {})):
            name = source.get("dtype") or source.get("torch_dtype")
            if isinstance(name, str):
                return name
        return ""

    @property
    def vision_config(self) -> dict:
        return self.config["vision_config"]

    @property
    def image_token_id(self) -> int:
        return self.config["image_token_id"]

    @property
    def video_token_id(self) -> int:
        return self.config["video_token_id"]

    @property
    def spatial_merge_size(self) -> int:
        return self.vision_config.get("spatial_merge_size", 2)

    @property
    def tokens_per_second(self) -> float:
        """Qwen2.5-VL spaces video frames in M-RoPE by time; the others by chunk index (0 here)."""
        return self.vision_config.get("tokens_per_second", 0) if self.family.time_spaced_video else 0

    @property
    def feature_sets(self) -> int:
        """Rows per visual token the encoder returns: the merged embedding, then one per deepstack layer."""
        deepstack = self.vision_config.get("deepstack_visual_indexes", ()) if self.family.deepstack else ()
        return 1 + len(deepstack)

    @property
    def max_position_embeddings(self) -> int:
        return int(self.text_config.get("max_position_embeddings", 32768))

    @cached_property
    def weights_fingerprint(self) -> Fingerprint:
        """Identity of the weights: the config and every byte of every safetensors file.

        NOTE: only the stages that load the weights compute this (they read the files anyway;
        xxh3 streams at memory speed); others learn it from a stage's Pong.
        """
        items: list[tuple[str, object]] = [("config", json.dumps(self.config, sort_keys=True))]
        for file in sorted(self.path.glob("*.safetensors")):
            items.append((file.name, _file_digest(file)))
        return fingerprint("weights", items)

    @property
    def name(self) -> str:
        return self.path.resolve().name


def _file_digest(file: Path) -> str:
    h = xxhash.xxh3_128()
    with open(file, "rb") as f:
        while block := f.read(16 << 20):
            h.update(block)
    return h.hexdigest()


def _weight_files(root: Path) -> dict[str, Path]:
    """Tensor name → file, from the shard index or the single file."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        mapping = json.loads(index.read_text())["weight_map"]
        return {name: root / file for name, file in mapping.items()}
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root} has no *.safetensors weights")
    out: dict[str, Path] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            out.update(dict.fromkeys(f.keys(), file))
    return out


def load_weights(root: str | os.PathLike, rename: Callable[[str], str | None]) -> dict[str, torch.Tensor]:
    """Load only the tensors ``rename`` maps to a name (``None`` skips the tensor)."""
    wanted: dict[Path, dict[str, str]] = {}
    for name, file in _weight_files(Path(root)).items():
        new = rename(name)
        if new is not None:
            wanted.setdefault(file, {})[name] = new
    out: dict[str, torch.Tensor] = {}
    for file, names in wanted.items():
        with safe_open(file, framework="pt") as f:
            for name, new in names.items():
                out[new] = f.get_tensor(name)
    return out


def vision_weight_name(name: str) -> str | None:
    """``model.visual.x`` (transformers 5) or ``visual.x`` (original checkpoints) → ``x``."""
    for prefix in ("model.visual.", "visual."):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return None


def text_weight_name(name: str) -> str | None:
    """Language-model tensors → ``model.x`` / ``lm_head.weight``; vision tensors → None."""
    if name.startswith("lm_head."):
        return name
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    if name.startswith("model.") and not name.startswith("model.visual."):
        return name
    return None
