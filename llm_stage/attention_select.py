"""Which attention backend a replica runs: the flag's wish against what the device can do.

``--attention-backend auto`` takes the best backend that runs here (FlashInfer's paged kernels
on CUDA when the library imports and supports the model's head size, else SDPA); a named
backend that cannot run falls back to SDPA with a warning that says why. The decision is a
pure function of its inputs (:func:`choose_backend`) so it is tested without a GPU.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mmcache.llm_stage.attention import AttentionBackend, SdpaBackend
from mmcache.llm_stage.kv_cache import KVCache

log = logging.getLogger(__name__)

# NOTE: the head sizes FlashInfer's prebuilt and JIT paged-attention kernels are instantiated for.
FLASHINFER_HEAD_DIMS = frozenset({64, 128, 256})
FLASHINFER_DTYPES = frozenset({torch.float16, torch.bfloat16})


@dataclass(frozen=True, slots=True)
class BackendChoice:
    name: str  # "sdpa" or "flashinfer": what runs
    wanted: str  # the flag's value
    reason: str  # why, in words (logged at start)

    @property
    def fell_back(self) -> bool:
        return self.wanted not in ("auto", self.name)


def flashinfer_importable() -> bool:
    """Whether ``import flashinfer`` would find the package (without importing it: that is slow)."""
    return importlib.util.find_spec("flashinfer") is not None


def choose_backend(
    wanted: str,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    importable: Callable[[], bool] = flashinfer_importable,
) -> BackendChoice:
    """The backend to run for ``--attention-backend wanted`` on ``device`` with this model."""
    if wanted == "sdpa":
        return BackendChoice("sdpa", wanted, "asked for")
    if device.type != "cuda":
        return BackendChoice("sdpa", wanted, f"flashinfer needs CUDA, the device is {device}")
    if dtype not in FLASHINFER_DTYPES:
        return BackendChoice("sdpa", wanted, f"flashinfer runs float16/bfloat16, the model is {dtype}")
    if head_dim not in FLASHINFER_HEAD_DIMS:
        dims = ", ".join(map(str, sorted(FLASHINFER_HEAD_DIMS)))
        return BackendChoice("sdpa", wanted, f"flashinfer supports head_dim {dims}, the model has {head_dim}")
    if not importable():
        return BackendChoice("sdpa", wanted, "flashinfer is not installed (pip install flashinfer-python)")
    return BackendChoice("flashinfer", wanted, "CUDA, flashinfer importable, head_dim supported")


def make_backend(
    choice: BackendChoice, kv: KVCache, num_heads: int, scaling: float, max_pages_per_seq: int = 0
) -> tuple[AttentionBackend, BackendChoice]:
    """Build the chosen backend; if FlashInfer fails to load, SDPA (the returned choice says so).

    ``max_pages_per_seq``: blocks of the longest sequence (sizes the CUDA-graph page buffers).
    """
    if choice.name == "flashinfer":
        try:
            from mmcache.llm_stage.attention_flashinfer import FlashInferBackend

            return FlashInferBackend(kv, num_heads, scaling, max_pages_per_seq), choice
        except Exception as exc:  # an import or CUDA error of the library: serve with SDPA instead
            choice = BackendChoice("sdpa", choice.wanted, f"flashinfer failed to load: {exc!r}")
    return SdpaBackend(kv, num_heads, scaling), choice


def log_choice(choice: BackendChoice) -> None:
    if choice.fell_back:
        log.warning("attention: %s asked for, running sdpa instead: %s", choice.wanted, choice.reason)
    else:
        log.info("attention: %s (%s)", choice.name, choice.reason)
