"""The decode-only step's layers as one C call on a CPU (:mod:`mmcache.shared.cpu_layers`).

:meth:`CpuDecode.run` takes the place of :class:`~mmcache.llm_stage.model_runner.ModelRunner`'s
layer loop for a step whose rows each decode one token (no prefill chunk, no media rows) and that
fits the packed kernel's rows. A layer qualifies when each of its four projections is packed for
``cpu_packed.c`` (bfloat16) or on ``cpu_half.c``'s float16 weights (float32), only the q/k/v
projection has a bias, its MLP is dense SiLU and it has no q/k norms; runs of qualifying layers go to C,
any other layer to the Python layer (so a layer whose weight the load-time probe kept on oneDNN
costs only itself). Same operators, same order: the same bits as the loop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mmcache.llm_stage.attention import SdpaBackend, SdpaPlan
from mmcache.llm_stage.kv_cache import KVCache
from mmcache.llm_stage.text_model import LayerWeights, TextLM
from mmcache.shared import cpu_kernels
from mmcache.shared.cpu_layers import DecodeLayers, DecodeRows, StackShape
from mmcache.shared.cpu_layers import LayerWeights as CLayer
from mmcache.shared.linear import Projection

# (first, last, in C): consecutive layers that run the same way
_Runs = list[tuple[int, int, bool]]
_Layer = Callable[[int, torch.Tensor], torch.Tensor]
_Rope = tuple[torch.Tensor, torch.Tensor]


# the projections' layout each step type's C layers take
_KIND = {torch.bfloat16: "onednn", torch.float32: "fp16"}


def _fits(w: LayerWeights, shape: StackShape, eps: float, silu: bool, dtype: torch.dtype) -> bool:
    """Whether ``cpu_layers.c`` computes layer ``w`` as the loop does: its operators, and the
    shapes and norm epsilon ``eps`` that ``shape`` gives every layer."""
    projections = (w.qkv, w.o, w.gate_up, w.down)
    if not silu or w.qk_norm is not None or w.moe is not None or w.eps != eps:
        return False
    if not all(p is not None and p.kind == _KIND[dtype] and p.kernels for p in projections):
        return False
    if any(p is not None and p.bias is not None for p in projections[1:]):
        return False
    attn = shape.heads * shape.head_dim
    want = [
        (attn + 2 * shape.kv_heads * shape.head_dim, shape.hidden),
        (shape.hidden, attn),
        (2 * shape.intermediate, shape.hidden),
        (shape.hidden, shape.intermediate),
    ]
    return [(p.out_features, p.in_features) for p in projections if p is not None] == want


class CpuDecode:
    """Runs of layers ``cpu_layers.c`` computes, the others left to the Python loop."""

    def __init__(self, layers: DecodeLayers, runs: _Runs):
        self.layers = layers
        self.runs = runs

    @classmethod
    def build(cls, lm: TextLM, kv: KVCache, attention: object) -> CpuDecode | None:
        """None where no layer qualifies, or the step's attention or dtype is not the kernels'."""
        lib = cpu_kernels.usable(kv.kv, lm.head_norm, dtypes=tuple(_KIND))
        if lib is None or not isinstance(attention, SdpaBackend) or attention.kernels is None:
            return None
        silu = lm.config.hidden_act == "silu"
        dense = next((w for w in lm.fused if w.gate_up is not None), None)
        if dense is None:
            return None
        shape = StackShape(
            lm.config.hidden_size,
            lm.num_heads,
            lm.num_kv_heads,
            lm.head_dim,
            dense.gate_up.out_features // 2,  # type: ignore[union-attr]
            kv.block_size,
            dense.eps,
            lm.scaling,
        )
        fits = [_fits(w, shape, dense.eps, silu, kv.kv.dtype) for w in lm.fused]
        if not any(fits):
            return None
        structs, keep = [], []
        half = kv.kv.dtype == torch.float32  # cpu_half.c's panels, else oneDNN's packed weights
        for idx, w in enumerate(lm.fused):
            if not fits[idx]:
                structs.append(CLayer())
                continue
            projections: list[Projection] = [w.qkv, w.o, w.gate_up, w.down]  # type: ignore[list-item]
            norms = [w.input_norm.contiguous(), w.post_norm.contiguous()]
            bias = w.qkv.bias.contiguous() if w.qkv.bias is not None else None
            cache = kv.kv[idx]
            assert cache.is_contiguous()
            keep += [*norms, cache] + ([bias] if bias is not None else [])
            # bfloat16: oneDNN's packed weights; float32: cpu_half.c's panels, o and down scaled
            # on the way out (q/k/v and gate/up have their scale in the norm before them)
            weights = [p.weight.data_ptr() if half else p.packed_address for p in projections]
            scales = (1.0, w.o.input_scale, 1.0, projections[3].input_scale) if half else (1.0,) * 4
            structs.append(
                CLayer(
                    norms[0].data_ptr(),
                    norms[1].data_ptr(),
                    weights[0],
                    None if bias is None else bias.data_ptr(),
                    *weights[1:],
                    cache.data_ptr(),
                    tuple(tuple(p.packed_chunks) for p in projections),
                    scales,
                )
            )
        runs: _Runs = []
        for idx, fit in enumerate(fits):
            if runs and runs[-1][2] == fit:
                runs[-1] = (runs[-1][0], idx + 1, fit)
            else:
                runs.append((idx, idx + 1, fit))
        return cls(DecodeLayers(lib, shape, structs, keep), runs)

    def takes(self, hidden: torch.Tensor, plan: SdpaPlan) -> bool:
        """Whether this step is one it runs: decodes only, as many rows as the packed kernel takes."""
        return not plan.prefills and 0 < hidden.shape[0] <= cpu_kernels.PACKED_ROWS and hidden.is_contiguous()

    def run(self, hidden: torch.Tensor, rope: _Rope, plan: SdpaPlan, layer: _Layer) -> torch.Tensor:
        """Every layer on ``hidden`` (rows, hidden): the qualifying ones in C (in place), the
        others through ``layer(idx, hidden)``; returns the last layer's output."""
        n = hidden.shape[0]
        assert plan.decode_blocks is not None and plan.decode_ends is not None
        rows = DecodeRows(
            rope[0].reshape(n, -1).contiguous(),
            rope[1].reshape(n, -1).contiguous(),
            plan.new_slots,
            plan.decode_blocks,
            plan.decode_ends,
        )
        for first, last, in_c in self.runs:
            if in_c:
                hidden = hidden.contiguous()  # in place: the loop's layers return new tensors
                self.layers.run(first, last, hidden, rows)
            else:
                for idx in range(first, last):
                    hidden = layer(idx, hidden)
        return hidden
