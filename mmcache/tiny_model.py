"""Offline, deterministic generator for tiny Qwen2-VL / Qwen2.5-VL / Qwen3-VL (dense, MoE) checkpoints.

``make_tiny_model(out_dir)`` writes a complete Hugging Face-format checkpoint (randomly initialised weights, a
byte-level BPE tokenizer trained on a small built-in corpus, image/video processor configs and the family's
chat template) without touching the network. Two runs produce byte-identical files, so the
checkpoint can be regenerated anywhere (tests, CI, benchmarks) instead of being downloaded.
This module writes it; the tokenizer comes from :mod:`mmcache.tiny_tokenizer`, and what differs per
family (configs, processors, chat templates) from :mod:`mmcache.tiny_families`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from mmcache.tiny_families import TINY_MODEL_ARCHS, build_processor, check_arch, model_class, model_config
from mmcache.tiny_presets import PRESETS, check_preset, preset

__all__ = ["PRESETS", "TINY_MODEL_ARCHS", "make_tiny_model"]

_SEED = 1234


def _save_model(arch: str, tokenizer: Any, out: Path, size: str) -> None:
    import torch
    from transformers import GenerationConfig

    config = model_config(arch, tokenizer, size)
    model_cls = model_class(arch)
    old_dtype = torch.get_default_dtype()
    # Leave the caller's global RNG and default dtype untouched.
    with torch.random.fork_rng(devices=[]):
        # NOTE: drawn in the saved dtype, so a bfloat16 preset never holds an fp32 copy (2b: 9 GB).
        torch.set_default_dtype(getattr(torch, preset(size).dtype))
        try:
            torch.manual_seed(_SEED)
            model = model_cls(config).eval()
        finally:
            torch.set_default_dtype(old_dtype)
    im_end, endoftext = config.text_config.eos_token_id, config.text_config.pad_token_id
    model.generation_config = GenerationConfig(
        bos_token_id=endoftext, eos_token_id=[im_end, endoftext], pad_token_id=endoftext, do_sample=False
    )
    model.save_pretrained(out, safe_serialization=True)


def _publish(tmp: Path, out: Path) -> None:
    """Rename the finished ``tmp`` onto ``out``, moving an existing checkpoint aside first."""
    for _ in range(5):
        try:
            os.rename(tmp, out)  # atomic; also replaces an empty directory
            return
        except OSError:
            if not out.exists():
                raise
        old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex}")
        try:
            os.rename(out, old)
        except FileNotFoundError:  # a concurrent writer moved it aside already
            continue
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
    raise OSError(f"could not move the generated checkpoint into place at {out}")


def make_tiny_model(out_dir: str | Path, arch: str = "qwen2-vl", size: str = "tiny") -> Path:
    """Generate a random ``arch`` checkpoint (Hugging Face format) of preset ``size``
    (:mod:`mmcache.tiny_presets`) into ``out_dir`` and return it.

    Fully offline and deterministic: the same ``arch`` and ``size`` always yield byte-identical files.
    The checkpoint is assembled in a temporary sibling directory and renamed into place, so readers
    never see a partial one; an existing ``out_dir`` is replaced.
    """
    check_arch(arch)
    check_preset(size)
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        processor = build_processor(arch)
        processor.save_pretrained(tmp)
        _save_model(arch, processor.tokenizer, tmp, size)
        # mkdtemp (and safetensors) create owner-only entries; use ordinary checkpoint permissions.
        tmp.chmod(0o755)
        for path in tmp.iterdir():
            path.chmod(0o644)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
