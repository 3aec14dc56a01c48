"""Checkpoint reading: both tensor-naming conventions, sharded files, and the fingerprint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mmcache.shared.checkpoint import (
    CheckpointError,
    ModelSpec,
    load_weights,
    text_weight_name,
    vision_weight_name,
)


def renamed_copy(src: Path, dst: Path, shards: int = 1) -> Path:
    """The same weights under transformers-5 names (model.visual.*, model.language_model.*)."""
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    state = load_file(src / "model.safetensors")
    new = {}
    for name, tensor in state.items():
        if name.startswith("visual."):
            new["model." + name] = tensor
        elif name.startswith("model."):
            new["model.language_model." + name[len("model.") :]] = tensor
        else:
            new[name] = tensor
    names = sorted(new)
    weight_map = {}
    for i in range(shards):
        part = {n: new[n] for n in names[i::shards]}
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, dst / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    if shards > 1:
        (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dst


@pytest.mark.parametrize("shards", [1, 3])
def test_both_naming_conventions_load_the_same_tensors(tiny_model, tmp_path, shards):
    other = renamed_copy(tiny_model, tmp_path / "renamed", shards)
    for rename in (vision_weight_name, text_weight_name):
        a, b = load_weights(tiny_model, rename), load_weights(other, rename)
        assert a.keys() == b.keys() and a
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_each_stage_reads_only_its_half(tiny_model):
    vision = load_weights(tiny_model, vision_weight_name)
    text = load_weights(tiny_model, text_weight_name)
    assert all(k.startswith(("blocks.", "patch_embed.", "merger.")) for k in vision)
    assert all(k.startswith(("model.", "lm_head.")) for k in text)
    assert "lm_head.weight" in text and "model.embed_tokens.weight" in text


def test_spec_reads_ids_and_eos(tiny_model):
    spec = ModelSpec.load(tiny_model)
    assert spec.model_type == "qwen2_vl"
    assert spec.image_token_id != spec.video_token_id
    assert set(spec.eos_token_ids) == {2000, 2002}
    assert spec.spatial_merge_size == 2


def test_fingerprint_follows_the_weights_not_the_path(tiny_model, tmp_path):
    copy = Path(shutil.copytree(tiny_model, tmp_path / "copy"))
    assert ModelSpec.load(copy).weights_fingerprint == ModelSpec.load(tiny_model).weights_fingerprint
    state = load_file(copy / "model.safetensors")
    name = next(k for k in state if k.startswith("model.layers.0"))
    state[name] = state[name] + 1.0
    save_file(state, copy / "model.safetensors", metadata={"format": "pt"})
    assert ModelSpec.load(copy).weights_fingerprint != ModelSpec.load(tiny_model).weights_fingerprint


def test_not_a_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match=r"config\.json"):
        ModelSpec.load(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(CheckpointError, match="model_type"):
        ModelSpec.load(tmp_path)


def test_each_family_is_described_once(tiny_models):
    """What differs between families is data: the stages read these fields, not model names."""
    got = {}
    for arch, path in tiny_models.items():
        spec = ModelSpec.load(path)
        fam = spec.family
        assert fam.arch == arch and fam.model_type == spec.model_type
        got[arch] = (spec.feature_sets, spec.tokens_per_second, fam.timestamped_video, fam.qk_norm)
    assert got == {
        "qwen2-vl": (1, 0, False, False),
        "qwen2.5-vl": (1, 2, False, False),
        "qwen3-vl": (4, 0, True, True),  # merged + 3 deepstack sets; timestamps; q/k norms
        "qwen3-vl-moe": (4, 0, True, True),  # the same, with routed experts in the text layers
    }
