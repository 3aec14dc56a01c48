"""Weight products (the decoder's, the vision tower's): ``F.linear``, or oneDNN over a weight packed
once at load.

On a CPU, torch's bfloat16 ``F.linear`` runs through oneDNN but keeps no packed weight between
calls: every call lays the weight out for the kernel again, so a batch-1 decode step, which is
nothing but reading weights, moves each weight several times. Packing each weight once
(``torch.ops.mkldnn._reorder_linear_weight``, the layout torch's own CPU compiler freezes weights
into) and calling the packed product reads it once: on a 2-core AVX512-BF16 VM the 24 layers of
Qwen2-0.5B's shape went from 78 to 37 ms a token at batch 1, and prefill got faster too.

Same kernel, same accumulation: the packed product equals ``F.linear`` bit for bit, for one row
(oneDNN's matrix-vector path) as for many. A weight is packed only after a probe at load shows
that equality on this machine; otherwise (float32, CUDA, a CPU without bfloat16 support) it stays
dense.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmcache.shared.torch_utils import cpu_has_bfloat16

_PROBE_ROWS = 5  # rows of the load-time check (and one row alone: a kernel of its own)


def packing_supported(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and cpu_has_bfloat16()


class Projection:
    """``x @ weight.T + bias`` over rows ``x`` (rows, in_features)."""

    __slots__ = ("bias", "nbytes", "numel", "packed", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight  # dense (out_features, in_features), or oneDNN's packed tensor
        self.bias = bias
        self.numel = weight.numel()
        self.nbytes = weight.numel() * weight.element_size()  # what a step reads
        self.packed = False
        if packing_supported(weight):
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
            if _same_as_dense(weight, bias, packed):
                self.weight, self.packed = packed, True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _same_as_dense(weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor) -> bool:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(_PROBE_ROWS, weight.shape[1], generator=gen).to(weight.dtype)
    batch = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    alone = torch.ops.mkldnn._linear_pointwise(x[:1], packed, bias, "none", [], "")
    return torch.equal(batch, F.linear(x, weight, bias)) and torch.equal(alone, F.linear(x[:1], weight, bias))


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose product runs through a :class:`Projection` (for model code that calls
    its linears as modules, such as a vision tower's blocks)."""

    def __init__(self, proj: Projection, in_features: int):
        super().__init__()
        self.proj = proj
        self.in_features = in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def pack_linears(module: nn.Module) -> int:
    """Replace every ``nn.Linear`` inside ``module`` whose weight packs by a :class:`PackedLinear`
    (the dense weight is let go); returns how many were replaced."""
    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            bias = None if child.bias is None else child.bias.detach()
            proj = Projection(child.weight.detach(), bias)
            if proj.packed:
                setattr(parent, name, PackedLinear(proj, child.in_features))
                replaced += 1
    return replaced
