"""Shared fixtures: the generated tiny checkpoints (both architectures)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmcache.tiny_model import TINY_MODEL_ARCHS, make_tiny_model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """arch → checkpoint directory, generated once per test session."""
    root = tmp_path_factory.mktemp("models")
    return {arch: make_tiny_model(root / arch, arch) for arch in TINY_MODEL_ARCHS}


@pytest.fixture(scope="session")
def tiny_model(tiny_models) -> Path:
    return tiny_models["qwen2-vl"]
