"""Device and dtype choices shared by the model-running stages."""

from __future__ import annotations

from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine")
    return device


def cpuinfo_line(*prefixes: str) -> str | None:
    """The first line of /proc/cpuinfo that starts with one of ``prefixes`` ("" if none does; None
    where there is no /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return next((line for line in text.splitlines() if line.startswith(prefixes)), "")


def cpu_vendor() -> str:
    """The CPU's ``vendor_id`` (``GenuineIntel``, ``AuthenticAMD``; "" where /proc/cpuinfo has none)."""
    return (cpuinfo_line("vendor_id") or "").partition(":")[2].strip()


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles that this process may use (torch's check: the instructions
    and the operating system's leave)."""
    return torch.cpu._is_amx_tile_supported()


def cpu_has_bfloat16() -> bool:
    """Whether this CPU computes in bfloat16 natively (AVX512-BF16 or AMX), through oneDNN.

    NOTE: oneDNN's own check also says yes on plain AVX512, where it emulates bfloat16: on such a
    2-core Xeon a bfloat16 2048² matmul ran at 0.06 TFLOP/s (float32 ~0.15) and a 512-token prefill
    of ``mid`` took 7 s. So the instructions are asked for by name.
    """
    native = torch.cpu._is_avx512_bf16_supported() or cpu_has_amx()
    return native and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def bfloat16_products_pay() -> bool:
    """Whether this CPU multiplies many-row matrices faster in bfloat16 than in float32.

    On Intel's cores without AMX, AVX512-BF16's dot product (one a cycle) has the peak of two
    float32 FMAs, and oneDNN's bfloat16 kernel mostly ran below MKL's float32 one: on a 2-core Intel
    Xeon with AVX512-BF16 and no AMX (2026-12-07), 316-2048 rows of ``mid``'s shapes, 0.075-0.164
    against 0.148-0.258 TFLOP/s (bfloat16 ahead only on the 4864-deep product at 316-512 rows). With
    AMX bfloat16 is the faster by far; on other CPUs with AVX512-BF16 (AMD's Zen 4) it is assumed
    to pay, as it did before this was measured (not compared there).
    """
    return cpu_has_bfloat16() and (cpu_has_amx() or cpu_vendor() != "GenuineIntel")


def resolve_dtype(name: str, device: torch.device, saved: str = "") -> torch.dtype:
    """``auto``: the dtype the checkpoint was saved in (``saved``), where the device computes in it.

    On CUDA a float32 checkpoint runs in bfloat16; on a CPU bfloat16 (and float16, which CPUs
    compute poorly) run in bfloat16 where the CPU has it, else float32. A float32 checkpoint stays
    float32 on a CPU (the tiny test checkpoints are saved so and compared with HF in it).
    """
    if name == "auto":
        if device.type == "cuda":
            return _DTYPES[saved] if saved in ("bfloat16", "float16") else torch.bfloat16
        if saved in ("bfloat16", "float16") and cpu_has_bfloat16():
            return torch.bfloat16
        return torch.float32
    if name not in _DTYPES:
        raise ValueError(f"--dtype must be auto or one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def set_threads(n: int) -> None:
    """Bound torch's intra-op CPU threads (0 keeps torch's default)."""
    if n > 0:
        torch.set_num_threads(n)
