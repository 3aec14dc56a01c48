"""Weight products over float16 weights in float32 (``cpu_half.c``, used by shared/linear.py): the
weight's layout and the call.

A bfloat16 checkpoint served in float32 on a CPU without bfloat16 instructions keeps its weights in
float16 (exact after a power-of-two scale). ``cpu_half.c`` sums every output in one order whatever
the number of rows, so a row's result never depends on its batch.
"""

from __future__ import annotations

import torch

from mmcache.shared.cpu_kernels import Kernels

HALF_PANEL = 16  # outputs a panel of mm_half_product's weight layout holds


def half_panels(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (n, k), values float16 holds exactly, n a multiple of HALF_PANEL, in
    ``cpu_half.c``'s layout: (n / 16, k, 16) float16, contiguous."""
    n, k = weight.shape
    assert n % HALF_PANEL == 0
    return weight.to(torch.float16).view(n // HALF_PANEL, HALF_PANEL, k).transpose(1, 2).contiguous()


def half_product(
    lib: Kernels,
    x: torch.Tensor,
    panels: torch.Tensor,
    scale: float = 1.0,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(x @ W.T) * scale + bias + residual`` in float32 for rows ``x`` (rows, k) float32 with its
    last dimension contiguous, ``panels`` = :func:`half_panels` of ``W`` (n, k); ``bias`` (n,) and
    ``residual`` (rows, n) contiguous float32 or None. Every output one multiply-add chain over the
    inputs in order: a row's result is the same whatever the rows beside it."""
    rows, k = x.shape
    n = panels.shape[0] * HALF_PANEL
    assert x.dtype == torch.float32 and x.stride(1) == 1 and panels.shape[1] == k
    out = torch.empty((rows, n), dtype=torch.float32)
    if rows:
        lib.half_product(
            x.data_ptr(),
            x.stride(0),
            rows,
            panels.data_ptr(),
            n,
            k,
            scale,
            None if bias is None else bias.data_ptr(),
            None if residual is None else residual.data_ptr(),
            out.data_ptr(),
        )
    return out
