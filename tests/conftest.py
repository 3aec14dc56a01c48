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


@pytest.fixture(scope="session")
def mid_model(tmp_path_factory) -> Path:
    """The ``mid`` preset (Qwen2-0.5B's text shape, ~410 M parameters) of Qwen2-VL: for the few tests
    where compute at a real size matters (~20 s to generate, 1.6 GB)."""
    return make_tiny_model(tmp_path_factory.mktemp("mid") / "qwen2-vl", "qwen2-vl", "mid")


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """In-process model tests share 2 cores with server processes: one intra-op thread each
    keeps them from fighting (and results do not depend on the thread count)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
