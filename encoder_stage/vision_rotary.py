"""The vision tower's rotary embedding as one compiled pass, bit for bit transformers' own.

Every family's vision attention calls its module's ``apply_rotary_pos_emb_vision`` (q and k widened
to float32, ``x * cos + rotate_half(x) * sin``, rounded back): eight eager operators and two float32
copies per call, ~37 ms of the ~157 ms a 448² image takes through ``mid``'s tower in bfloat16 on a
2-core Xeon. :func:`install` puts a wrapper in the module's place that runs
:func:`mmcache.shared.cpu_kernels.rotate_vision` (the same operations in the same order, so the
same bits) while :func:`.tower_kernels.active` holds the kernels (the tower's own forward), the
original elsewhere.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from mmcache.encoder_stage import tower_kernels
from mmcache.shared import cpu_kernels

NAME = "apply_rotary_pos_emb_vision"

Rotary = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _wrap(original: Rotary) -> Rotary:
    def rotary(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lib = tower_kernels.current()
        if lib is None or not _fits(q, k, cos, sin):
            return original(q, k, cos, sin)
        return cpu_kernels.rotate_vision(lib, q, cos, sin), cpu_kernels.rotate_vision(lib, k, cos, sin)

    rotary.mmcache_original = original  # type: ignore[attr-defined]
    return rotary


def _fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """The shapes and dtypes the kernel takes (anything else runs the original)."""
    qk = q.dtype in (torch.bfloat16, torch.float32) and all(
        t.dim() == 3 and t.dtype == q.dtype and t.stride(2) == 1 for t in (q, k)
    )
    tables = all(t.dtype == torch.float32 and t.is_contiguous() for t in (cos, sin))
    return (
        qk
        and tables
        and q.device.type == "cpu"
        and cos.shape == sin.shape == (q.shape[0], q.shape[2])
        and k.shape[0] == q.shape[0]
        and k.shape[2] == q.shape[2]
    )


def install(module_name: str) -> bool:
    """Wrap ``module_name``'s rotary function (once); False where the module has none."""
    module = sys.modules.get(module_name)
    current = getattr(module, NAME, None)
    if current is None:
        return False
    if not hasattr(current, "mmcache_original"):
        setattr(module, NAME, _wrap(current))
    return True
