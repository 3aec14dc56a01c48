"""A decode step's decoder layers in one C call (``cpu_layers.c``).

The layer of :mod:`mmcache.llm_stage.model_runner` is ~10 compiled operators; called one by one
from Python they cost ~10 ctypes calls and tensor allocations a layer, ~2 ms of a ~22 ms ``mid``
decode step on a 2-core CPU, while the kernels' helper thread waits. :class:`DecodeLayers` runs a
range of layers in one call, through the same compiled functions in the same order on the same
inputs: the result is the Python loop's bit for bit (a test holds the two equal).

Only for what those functions cover: bfloat16 with every projection packed for ``cpu_packed.c``,
or float32 with every projection on ``cpu_half.c``'s float16 weights; a dense SiLU MLP, no q/k
norms, rows that each decode one token. The caller keeps its loop for the rest.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from mmcache.shared import cpu_kernels

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


class LayerWeights(ctypes.Structure):
    """``mm_layer_t``: one layer's addresses (its norms carry their projection's input scale)."""

    _fields_ = [
        ("input_norm", _ptr),
        ("post_norm", _ptr),
        ("qkv", _ptr),
        ("qkv_bias", _ptr),
        ("o", _ptr),
        ("gate_up", _ptr),
        ("down", _ptr),
        ("cache", _ptr),
        ("chunks", (_i64 * 2) * 4),  # bf16: partial-sum lengths of qkv, o, gate_up, down: one row, more
        ("scales", ctypes.c_float * 4),  # float32: output scale of qkv, o, gate_up, down
    ]


class StackShape(ctypes.Structure):
    """``mm_stack_t``."""

    _fields_ = [
        ("hidden", _i64),
        ("heads", _i64),
        ("kv_heads", _i64),
        ("head_dim", _i64),
        ("intermediate", _i64),
        ("block_size", _i64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
    ]


@dataclass(frozen=True, slots=True)
class DecodeRows:
    """What the step's rows attend with: rotary tables (rows, head_dim) of the step's type, the cache slot of
    each row's token, each row's block ids (rows * width) and context length, all int64."""

    cos: torch.Tensor
    folded_sin: torch.Tensor
    slots: torch.Tensor
    tables: torch.Tensor
    lengths: torch.Tensor


class DecodeLayers:
    """Layers of one model as ``cpu_layers.c`` runs them; ``keep`` holds the tensors whose
    addresses ``layers`` lists (norm weights, biases, packed weights, caches)."""

    def __init__(self, lib: cpu_kernels.Kernels, shape: StackShape, layers: list[LayerWeights], keep: list):
        self.lib = lib
        self.shape = shape
        self.layers = (LayerWeights * len(layers))(*layers)
        self._keep = keep

    def run(self, first: int, last: int, hidden: torch.Tensor, rows: DecodeRows) -> None:
        """Layers ``first .. last`` on ``hidden`` (rows, hidden) bfloat16 or float32 (the layers'
        type), in place."""
        n = hidden.shape[0]
        assert hidden.is_contiguous() and 0 < n <= cpu_kernels.PACKED_ROWS
        assert rows.cos.is_contiguous() and rows.folded_sin.is_contiguous() and rows.tables.shape[0] % n == 0
        assert rows.cos.dtype == hidden.dtype in (torch.bfloat16, torch.float32)
        scratch = torch.empty(self.lib.decode_scratch(ctypes.byref(self.shape), n), dtype=hidden.dtype)
        call = self.lib.decode_layers if hidden.dtype == torch.bfloat16 else self.lib.decode_layers_f32
        call(
            ctypes.byref(self.shape),
            self.layers,
            first,
            last,
            hidden.data_ptr(),
            n,
            rows.cos.data_ptr(),
            rows.folded_sin.data_ptr(),
            rows.slots.data_ptr(),
            rows.tables.data_ptr(),
            rows.tables.shape[0] // n,
            rows.lengths.data_ptr(),
            scratch.data_ptr(),
        )
