"""Weight products (the decoder's, the vision tower's): ``F.linear``, or a weight laid out once at
load for a faster CPU kernel.

Two layouts, each chosen only where it computes what the checkpoint says:

- **oneDNN, packed bfloat16** (a CPU with AVX512-BF16 or AMX, bfloat16 compute). torch's bfloat16
  ``F.linear`` runs through oneDNN but keeps no packed weight between calls: every call lays the
  weight out for the kernel again. Packing each weight once
  (``torch.ops.mkldnn._reorder_linear_weight``, the layout torch's own CPU compiler freezes weights
  into) reads it once: on a 2-core AVX512-BF16 VM the 24 layers of Qwen2-0.5B's shape went from 78
  to 37 ms a token at batch 1. Same kernel, same accumulation: the packed product equals
  ``F.linear`` bit for bit, for one row as for many (a probe at load checks it on this machine).
  A residual addition after a product (:meth:`Projection.add_to`) runs inside the kernel, on its
  float32 sums, rounded to bfloat16 once where eager rounds twice: one operator fewer per product
  (a 230- or 512-token prefill of Qwen2-0.5B's shape 3-5% faster on a 2-core AMX Xeon, decode
  unchanged), results within that one rounding of eager's, alike for any number of rows.
  Products of up to 64 rows (decode steps) run through ``cpu_packed.c`` over the same packed
  weight, on AMX or on AVX512-BF16, where it computes oneDNN's result bit for bit (a probe at
  load): the same instruction in the same order, without torch's dispatch and oneDNN's set-up per
  call, on helper threads that do not sleep between a step's products (``cpu_pool.c``). The 96
  products of a ``mid`` decode step (Qwen2-0.5B's 24 layers), back to back, one row: 28.8 ms
  against oneDNN's 33.5 on a 2-core AMX Xeon (the step in the engine from 41 to 30 ms), 25-26
  against 33-38 on a 2-core AMD EPYC with AVX512-BF16 (the step from 48 to 27 ms).
- **FBGEMM, float16 weights with float32 arithmetic** (float32 compute on a CPU, where the weight's
  values fit float16 exactly: a bfloat16 checkpoint served in float32 on a CPU without bfloat16
  kernels). A batch-1 decode step reads every weight once, so its time is the weight bytes over
  the memory's speed; float32 weights are twice the checkpoint's bytes. FBGEMM (shipped inside
  torch, its dynamic-fp16 linear) keeps the weight in float16, widens it in registers and
  multiplies and sums in float32: the values are the checkpoint's, the bytes half. A bfloat16
  value has 8 significant bits, float16 11 but a narrower exponent range, so the weight is scaled
  by a power of two first (exact) and the output scaled back (exact); a weight with any value that
  would not survive the round trip stays dense float32. The sums run in another order than MKL's
  (differences at float32's rounding, as between any two float32 kernels). Where the compiled
  kernels run (AVX2 with F16C, or AVX-512), ``cpu_half.c`` takes the float16 weight instead of
  FBGEMM, for any number of rows: FBGEMM rounds a row otherwise beside other rows than alone (a
  row's output changes with its batch; measured on AMD EPYC Zen 3 for 2 to 64 rows), and reads a
  decode step's weights below the machine's read rate. ``cpu_half.c`` sums every output in one
  order whatever the rows (a batch never changes a row), the scale, bias and residual joined on
  the way out.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mmcache.shared import cpu_half, cpu_kernels
from mmcache.shared.torch_utils import cpu_has_bfloat16

_PROBE_ROWS = 5  # rows of the load-time check (and one row alone: a kernel of its own)
_HALF_TOP = 14  # a half weight's largest magnitude is scaled into (2**13, 2**14]: far below float16's max
# NOTE: the operators' overloads, not their packets: a packet's call checks in Python how to dispatch
# (~30 us a call on a 2-core VM: 3 ms of a 97-product decode step).


def _overload(
    namespace: str, name: str, overload: str = "default"
) -> tuple[Callable[..., torch.Tensor], bool]:
    """The operator's overload (``default`` unless named), and whether this build of torch has it."""
    try:
        return getattr(getattr(getattr(torch.ops, namespace), name), overload), True
    except (AttributeError, RuntimeError):
        return F.linear, False  # never called: the layout that needs it is never chosen


_ONEDNN_PRODUCT, _HAS_PRODUCT = _overload("mkldnn", "_linear_pointwise")
# The same product with a tensor combined into its float32 sums before they are rounded once
# ("add": a residual, see Projection.add_to).
_ONEDNN_BINARY, _HAS_BINARY = _overload("mkldnn", "_linear_pointwise", "binary")
_HAS_ONEDNN = _HAS_PRODUCT and _HAS_BINARY
_HALF_PRODUCT, _HAS_HALF = _overload("quantized", "linear_dynamic_fp16")
_PACKED_ADDRESS, _HAS_ADDRESS = _overload("mkldnn", "data_ptr")
_PACKED_BYTES, _HAS_BYTES = _overload("mkldnn", "_nbytes")
_PACKED_BLOCK, _PACKED_K_STEP = 64, 32  # the packed layout's output block and an AMX tile's inputs
_PACKED_PROBE_ROWS = 21  # more than a pass takes (16 rows on AMX, 6 on AVX512-BF16): a second pass too
_VEC_CHUNKS = (256, 512, 128, 0)  # AVX512-BF16: oneDNN's partial-sum lengths (input pairs) to try
_PROBE_VALUES = 1 << 15  # outputs the packed kernel's probe compares with oneDNN's, at most
_PROBE_MAX_ROWS = 512  # (rows for it)
_PROBE_SINGLES = 48  # rows the AVX512-BF16 probe multiplies one at a time, at most


def packing_supported(weight: torch.Tensor) -> bool:
    return (
        _HAS_ONEDNN and weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and cpu_has_bfloat16()
    )


def half_supported(weight: torch.Tensor) -> bool:
    """Whether float32 ``weight`` may run through a float16-weight product here (``cpu_half.c``
    or FBGEMM's)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return False
    fbgemm = _HAS_HALF and "fbgemm" in torch.backends.quantized.supported_engines
    return fbgemm or _half_kernels(weight) is not None


def _half_kernels(weight: torch.Tensor) -> cpu_kernels.Kernels | None:
    """The kernels, where ``cpu_half.c`` multiplies by ``weight`` (its outputs in whole panels)."""
    lib = cpu_kernels.kernels()
    if lib is None or not lib.half_isa or weight.shape[0] % cpu_half.HALF_PANEL or not lib.start_helpers():
        return None
    return lib


def half_scaled(weight: torch.Tensor) -> tuple[int, torch.Tensor] | None:
    """The power of two ``s`` for which ``weight * 2**s`` is exactly a float16 tensor, and that
    product (still float32, for the prepack), or None."""
    top = float(weight.abs().max()) if weight.numel() else 0.0
    if not math.isfinite(top):
        return None
    scale = _HALF_TOP - math.ceil(math.log2(top)) if top > 0 else 0
    scaled = weight * 2.0**scale
    return (scale, scaled) if torch.equal(scaled.half().float(), scaled) else None


class Projection:
    """``x @ weight.T + bias`` over rows ``x`` (rows, in_features).

    ``half``: allow the float16-weight layout (decoder weights; the vision tower, whose products
    are many rows each, keeps MKL's float32 kernel).
    """

    __slots__ = (
        "bias",
        "half_scale",
        "in_features",
        "kernels",
        "kind",
        "nbytes",
        "numel",
        "out_features",
        "packed_address",
        "packed_chunks",
        "weight",
    )

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, half: bool = True):
        self.weight = weight  # dense (out_features, in_features), or a kernel's packed weight
        self.bias = bias
        self.numel = weight.numel()
        self.nbytes = weight.numel() * weight.element_size()  # what a step reads
        self.out_features, self.in_features = weight.shape if weight.dim() == 2 else (0, 0)
        self.kind = "dense"
        self.half_scale = 0
        self.kernels: cpu_kernels.Kernels | None = None  # few-row products (cpu_packed.c), or cpu_half.c
        self.packed_address = 0  # the packed weight's address, for them
        self.packed_chunks = (0, 0)  # their partial-sum lengths, one row and more (cpu_packed.c)
        if packing_supported(weight):
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
            if _same_as_dense(weight, bias, packed):
                self.weight, self.kind = packed, "onednn"
                found = _packed_kernels(weight, bias, packed)
                if found is not None:
                    self.kernels, self.packed_chunks = found
                    self.packed_address = int(_PACKED_ADDRESS(packed))
        elif half and half_supported(weight) and (fits := half_scaled(weight)) is not None:
            self.half_scale, scaled = fits
            self.kind, self.nbytes = "fp16", self.numel * 2
            self.kernels = _half_kernels(weight)
            if self.kernels is not None:  # cpu_half.c's panels
                self.weight = cpu_half.half_panels(scaled)
                self.bias = None if bias is None else bias.float().contiguous()
            else:
                self.weight = torch.ops.quantized.linear_prepack_fp16(scaled, None)

    @property
    def packed(self) -> bool:
        """Whether the weight lives in a kernel's own layout (the dense tensor can be let go)."""
        return self.kind != "dense"

    @property
    def input_scale(self) -> float:
        """What :meth:`prescaled` wants its input multiplied by (a power of two; 1.0 for the
        layouts that need none)."""
        return 2.0**-self.half_scale

    def _half(self, x: torch.Tensor, scale: float, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``cpu_half.c``'s product: ``(x @ W.T) * scale + bias + residual``, rows in any number."""
        assert self.kernels is not None
        flat = x.reshape(-1, self.in_features)
        if flat.stride(1) != 1:
            flat = flat.contiguous()
        if residual is not None:
            residual = residual.reshape(-1, self.out_features).contiguous()
        out = cpu_half.half_product(self.kernels, flat, self.weight, scale, self.bias, residual)
        if len(flat) > cpu_kernels.PACKED_ROWS:  # a prefill: torch's threaded operators come next
            cpu_kernels.rest_helpers()
        return out.view(*x.shape[:-1], self.out_features)

    def _few_rows(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes to ``cpu_packed.c`` (else to a kernel with OpenMP threads, before which
        the kernels' helper threads are sent to sleep)."""
        few = self.kernels is not None and x.dim() == 2 and 0 < x.shape[0] <= cpu_kernels.PACKED_ROWS
        if few and x.shape[1] == self.in_features and x.stride(1) == 1:
            return True
        cpu_kernels.rest_helpers()
        return False

    def _packed(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``cpu_packed.c``'s product (rows :meth:`_few_rows` let through), in oneDNN's order for
        one row or for more."""
        assert self.kernels is not None
        chunk = self.packed_chunks[x.shape[0] > 1]
        n = self.out_features
        return cpu_kernels.packed_product(self.kernels, x, self.packed_address, n, self.bias, residual, chunk)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind != "fp16" or not self.half_scale:
            return self.prescaled(x)
        if self.kernels is not None:
            return self._half(x, self.input_scale)
        cpu_kernels.rest_helpers()
        out = _HALF_PRODUCT(x, self.weight).mul_(self.input_scale)
        return out if self.bias is None else out.add_(self.bias)

    def prescaled(self, x: torch.Tensor) -> torch.Tensor:
        """The product of an input already multiplied by :attr:`input_scale`: a caller that folds
        the scale into the operator before (a norm's weight) saves the product's own multiply.

        NOTE: exact, not approximate: a power of two commutes with every rounding (away from
        float32's subnormals), so the sums equal those of the unscaled input and scaled output.
        """
        if self.kind == "fp16" and self.kernels is not None:
            return self._half(x, 1.0)
        if self._few_rows(x):
            return self._packed(x)
        if self.kind == "onednn":
            return _ONEDNN_PRODUCT(x, self.weight, self.bias, "none", [], "")
        if self.kind == "fp16":
            out = _HALF_PRODUCT(x, self.weight)
            return out if self.bias is None else out.add_(self.bias)
        return F.linear(x, self.weight, self.bias)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``, the output's scale folded into the addition (exact as above).

        NOTE: on oneDNN the residual joins the float32 sums inside the kernel, rounded to
        bfloat16 once (eager rounds the product, then the sum): one operator fewer, and a result
        that differs from eager's only by that one rounding, the same for any number of rows.
        """
        if self.kind == "onednn" and residual.is_contiguous():
            if self._few_rows(x):
                return self._packed(x, residual)
            return _ONEDNN_BINARY(x, residual, self.weight, self.bias, "add")
        if self.kind == "fp16" and self.kernels is not None:
            return self._half(x, self.input_scale, residual)
        cpu_kernels.rest_helpers()
        if self.kind != "fp16" or self.bias is not None:
            return residual + self(x)
        return torch.add(residual, _HALF_PRODUCT(x, self.weight), alpha=self.input_scale)


def _same_as_dense(weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor) -> bool:
    """The packed product equals ``F.linear`` bit for bit, for one row as for many; a residual
    of zeros joined in the kernel (:meth:`Projection.add_to`) leaves it unchanged.

    NOTE: each row count against ``F.linear`` at the same row count: oneDNN's AVX512-BF16 kernel
    (without AMX) changes the length of its partial sums with the row count, so there a row among
    five may differ in rounding from the same row alone, packed or not.
    """
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(_PROBE_ROWS, weight.shape[1], generator=gen).to(weight.dtype)
    batch = _ONEDNN_PRODUCT(x, packed, bias, "none", [], "")
    alone = _ONEDNN_PRODUCT(x[:1], packed, bias, "none", [], "")
    joined = _ONEDNN_BINARY(x, torch.zeros_like(batch), packed, bias, "add")
    dense = F.linear(x, weight, bias)
    return (
        torch.equal(batch, dense)
        and torch.equal(alone, F.linear(x[:1], weight, bias))
        and torch.equal(joined, dense)
    )


def _packed_kernels(
    weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor
) -> tuple[cpu_kernels.Kernels, tuple[int, int]] | None:
    """The kernels, where ``cpu_packed.c`` multiplies by ``packed`` as oneDNN does bit for bit,
    and the partial-sum lengths (``cpu_packed.c``'s ``chunk``) for one row and for more; else None.

    Checked on probe rows, with the residual joined or not: alone, five and 21 at a time, and on
    AVX512-BF16 then in batches of up to 64 until ~2**15 outputs were compared. AMX has one
    order. On AVX512-BF16, oneDNN's kernel sums the input pairs in partial sums whose length
    depends on the weight's inputs and on whether there is more than one row (on a 2-core AMD
    EPYC: 256 pairs for 896 inputs; for 4864, 256 for one row and 512 for more): the probe tries
    the likely lengths and keeps the first that gives oneDNN's bits.
    """
    lib = cpu_kernels.kernels()
    n, k = weight.shape
    if (
        lib is None
        or not lib.packed_isa
        or not (_HAS_ADDRESS and _HAS_BYTES)
        or n % _PACKED_BLOCK
        or k % _PACKED_K_STEP
    ):
        return None
    if bias is not None and not (bias.is_contiguous() and bias.dtype == torch.bfloat16):
        return None
    if int(_PACKED_BYTES(packed)) != weight.numel() * weight.element_size():  # padded: another layout
        return None
    if not lib.start_helpers():
        return None
    # NOTE: on AVX512-BF16 a wrong order shows in about one output in 5000, so the probe compares
    # ~2**15 of them: more rows for a weight with few outputs (cheap: such a weight is small).
    # NOTE: on AMX 1, 5 and 21 rows only: over a 4864-input weight oneDNN's AMX product of 33 or 64
    # rows rounds a row otherwise than its product of that row alone; this kernel gives the latter.
    tiles = lib.packed_isa == "amx"
    wanted = (
        _PACKED_PROBE_ROWS if tiles else min(_PROBE_MAX_ROWS, max(_PACKED_PROBE_ROWS, -(-_PROBE_VALUES // n)))
    )
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(wanted, k, generator=gen).to(weight.dtype)
    residual = torch.randn(wanted, n, generator=gen).to(weight.dtype)
    address = int(_PACKED_ADDRESS(packed))

    def agrees(chunk: int, batches: list[torch.Tensor], join: bool = True) -> bool:
        for rows in batches:
            ours = cpu_kernels.packed_product(lib, rows, address, n, bias, chunk=chunk)
            if not torch.equal(ours, _ONEDNN_PRODUCT(rows, packed, bias, "none", [], "")):
                return False
            if join:
                add = residual[: len(rows)]
                joined = cpu_kernels.packed_product(lib, rows, address, n, bias, add, chunk)
                if not torch.equal(joined, _ONEDNN_BINARY(rows, add, packed, bias, "add")):
                    return False
        return True

    many = [x[:_PROBE_ROWS], x[:_PACKED_PROBE_ROWS]]
    many += [
        x[i : i + cpu_kernels.PACKED_ROWS] for i in range(_PACKED_PROBE_ROWS, wanted, cpu_kernels.PACKED_ROWS)
    ]
    if tiles:
        return (lib, (0, 0)) if agrees(0, [x[:1], *many]) else None
    singles = [x[i : i + 1] for i in range(min(wanted, _PROBE_SINGLES))]
    one = next(
        (c for c in _VEC_CHUNKS if agrees(c, singles[:1]) and agrees(c, singles[1:], join=False)), None
    )
    more = next((c for c in _VEC_CHUNKS if agrees(c, many)), None)
    return None if one is None or more is None else (lib, (one, more))


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
    """Replace every ``nn.Linear`` inside ``module`` whose weight packs for oneDNN by a
    :class:`PackedLinear` (the dense weight is let go); returns how many were replaced."""
    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            bias = None if child.bias is None else child.bias.detach()
            proj = Projection(child.weight.detach(), bias, half=False)
            if proj.packed:
                setattr(parent, name, PackedLinear(proj, child.in_features))
                replaced += 1
    return replaced
