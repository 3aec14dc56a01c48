"""Sizing the KV pool: the flag when given, else from the device."""

from __future__ import annotations

import torch

from mmcache.llm_stage.kv_cache import CUDA_MEMORY_FRACTION, DEFAULT_CPU_GB, kv_budget_bytes

GIB = 1 << 30


def test_the_flag_wins_on_any_device():
    assert kv_budget_bytes(1.5, torch.device("cpu")) == int(1.5 * GIB)
    assert kv_budget_bytes(2.0, torch.device("cuda"), free_bytes=80 * GIB) == 2 * GIB


def test_on_cuda_the_budget_is_a_fraction_of_the_free_memory():
    assert kv_budget_bytes(0.0, torch.device("cuda"), free_bytes=40 * GIB) == int(
        40 * GIB * CUDA_MEMORY_FRACTION
    )


def test_on_cpu_the_default_applies():
    assert kv_budget_bytes(0.0, torch.device("cpu")) == int(DEFAULT_CPU_GB * GIB)
