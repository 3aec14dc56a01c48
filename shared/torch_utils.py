"""Device and dtype choices shared by the model-running stages."""

from __future__ import annotations

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"--dtype must be auto or one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def set_threads(n: int) -> None:
    """Bound torch's intra-op CPU threads (0 keeps torch's default)."""
    if n > 0:
        torch.set_num_threads(n)
