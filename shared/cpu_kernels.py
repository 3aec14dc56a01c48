"""The decoder layer's small operators in one pass each, on bfloat16 or float32 CPU tensors
(``cpu_kernels.c``, attention in ``cpu_attention.c``).

Between its weight products a decoder layer runs an RMSNorm, the rotary embedding, attention over
the cache and SiLU(gate) * up. Eager PyTorch spends ~35 operators a layer on them (the RMSNorm alone
is eight: widen, square, mean, add, rsqrt, two multiplies, round), each a dispatch, an allocation
and a pass over memory: ~11 ms of a 53 ms batch-1 decode step of Qwen2-0.5B's shape on a 2-core Xeon,
and a quarter of a 512-token prefill. Each kernel here is one C function called through ctypes,
for bfloat16 rows and (a float32 model's) float32 rows alike.

The source is compiled on first use on the machine that runs it (``cc -O3 -march=native -fopenmp``),
into ``$MMCACHE_HOME/kernels`` (default ``~/.cache/mmcache``) under a name that hashes the source,
the compiler and the CPU's flags, so a cached library never runs on a CPU it was not built for.
Without a C compiler, or with ``MMCACHE_CPU_KERNELS=0``, :func:`kernels` returns None and the model
runs eager PyTorch. Results: the rotary embedding equals eager's bit for bit; the RMSNorm, SiLU and
attention sum in another order (within a rounding of eager's); and every row is computed alike
whatever the number of rows, so batching never changes a row. Prefill attention goes further: a
prompt row's attention is the same whether its prompt ran in one step, in chunks, or from a prefix
hit on (given the same cached K/V); a single-token decode takes decode attention, which sums in
another order. The vision towers' rotary embedding (``mm_rotate_vision``,
:mod:`mmcache.encoder_stage.vision_rotary`) and attention (``mm_vision_attention``,
:mod:`mmcache.encoder_stage.vision_attention`) are here too.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from mmcache.shared.torch_utils import cpuinfo_line

log = logging.getLogger(__name__)

# The small operators (``cpu_kernels.c``), attention (``cpu_attention.c``), the few-row weight
# product (``cpu_packed.c``, used by shared/linear.py), the float16-weight product
# (``cpu_half.c``, likewise), the helper threads they share (``cpu_pool.c``), and a decode step's
# layers built of them (``cpu_layers.c``, used by shared/cpu_layers.py).
_SOURCE_NAMES = (
    "cpu_kernels.c",
    "cpu_attention.c",
    "cpu_packed.c",
    "cpu_half.c",
    "cpu_pool.c",
    "cpu_layers.c",
)
SOURCES = [Path(__file__).with_name(name) for name in _SOURCE_NAMES]
HEADERS = [Path(__file__).with_name(name) for name in ("cpu_pool.h", "cpu_ops.h", "cpu_lanes.h")]
FLAGS = [
    "-O3",
    "-march=native",
    "-ffp-contract=off",  # no fused multiply-adds (but in the attention kernels that ask for them)
    "-fno-math-errno",
    "-fno-trapping-math",  # lets gcc vectorise floorf (the exp's range reduction)
    "-Wno-psabi",  # 64-byte vectors on a CPU without AVX-512: only static functions pass them
    "-fopenmp",
    "-fPIC",
    "-shared",
]
if platform.machine() in ("x86_64", "AMD64"):
    FLAGS.append("-mprefer-vector-width=512")  # where AVX-512 exists, use its full width
COMPILE_TIMEOUT_S = 120
ENV_SWITCH = "MMCACHE_CPU_KERNELS"

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
# q, q_stride, k, k_stride, v, v_stride, block_size, table, rows, start, out, heads, kv_heads, head_dim, scale
_PREFILL = [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _f32]
_PACKED_ISAS = ("", "avx512-bf16", "amx")  # mm_packed_isa's answers
_HALF_ISAS = ("", "avx2", "avx512f")  # mm_half_isa's answers
_VISION = [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _f32, _ptr]
_SIGNATURES = {
    "mm_rms_norm": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _f32],
    "mm_rms_norm_f32": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _f32],
    "mm_rotate": [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr],
    "mm_rotate_f32": [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr],
    "mm_rotate_vision": [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr],
    "mm_rotate_vision_f32": [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr],
    "mm_silu_mul": [_ptr, _ptr, _i64, _i64],
    "mm_silu_mul_f32": [_ptr, _ptr, _i64, _i64],
    "mm_decode_attention": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _f32],
    "mm_decode_attention_f32": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _f32],
    "mm_prefill_attention": _PREFILL,
    "mm_prefill_attention_f32": _PREFILL,
    "mm_vision_attention": _VISION,
    "mm_vision_attention_f32": _VISION,
    "mm_packed_product": [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64],
    "mm_half_product": [_ptr, _i64, _i64, _ptr, _i64, _i64, _f32, _ptr, _ptr, _ptr],
    "mm_decode_layers": [_ptr, _ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr],
    "mm_decode_layers_f32": [_ptr, _ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr],
}


def _cache_dir() -> Path:
    home = os.environ.get("MMCACHE_HOME") or Path.home() / ".cache" / "mmcache"
    return Path(home) / "kernels"


def _cpu_flags() -> str:
    line = cpuinfo_line("flags", "Features")
    return platform.processor() if line is None else line


def _compile(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(
        "\0".join(
            [
                *(s.read_text() for s in SOURCES + HEADERS),
                version,
                " ".join(FLAGS),
                _cpu_flags(),
                platform.machine(),
            ]
        ).encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run(
            [compiler, *FLAGS, "-o", str(built), *map(str, SOURCES), "-lm"],
            capture_output=True,
            text=True,
            check=True,
            timeout=COMPILE_TIMEOUT_S,
        )
        os.replace(built, target)  # atomic: concurrent builders each leave a whole library
    return target


class Kernels:
    """The compiled library's functions, typed for ctypes."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        for name, args in _SIGNATURES.items():
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = None
        self.rms_norm = lib.mm_rms_norm
        self.rotate = lib.mm_rotate
        self.rotate_vision = lib.mm_rotate_vision
        self.silu_mul = lib.mm_silu_mul
        # the layer's operators on float32 rows (a float32 model): by dtype, as the functions below pick
        self.float32 = {
            "rms_norm": lib.mm_rms_norm_f32,
            "rotate": lib.mm_rotate_f32,
            "silu_mul": lib.mm_silu_mul_f32,
            "rotate_vision": lib.mm_rotate_vision_f32,
        }
        self.decode_attention = lib.mm_decode_attention
        self.decode_attention_f32 = lib.mm_decode_attention_f32  # a float32 cache, query and output
        self.prefill_attention = lib.mm_prefill_attention
        self.prefill_attention_f32 = lib.mm_prefill_attention_f32
        self.vision_attention = lib.mm_vision_attention
        self.vision_attention_f32 = lib.mm_vision_attention_f32
        self.packed_product = lib.mm_packed_product
        self.half_product = lib.mm_half_product  # cpu_half.c
        self.decode_layers = lib.mm_decode_layers  # cpu_layers.c
        self.decode_layers_f32 = lib.mm_decode_layers_f32  # (float32 rows, cpu_half.c's products)
        lib.mm_decode_scratch.argtypes, lib.mm_decode_scratch.restype = [_ptr, _i64], _i64
        self.decode_scratch = lib.mm_decode_scratch
        lib.mm_packed_isa.restype = lib.mm_half_isa.restype = lib.mm_pool_start.restype = ctypes.c_int
        lib.mm_pool_start.argtypes = [_i64]
        lib.mm_pool_rest.argtypes, lib.mm_pool_rest.restype = [], None
        lib.mm_pool_sleeping.argtypes, lib.mm_pool_sleeping.restype = [], ctypes.c_int64
        self.pool_sleeping = lib.mm_pool_sleeping  # helpers asleep now
        self._pool_start = lib.mm_pool_start
        self.pool_rest = lib.mm_pool_rest
        self.helpers = 0  # helper threads started (cpu_pool.c)
        # NOTE: asks the kernel for the tile registers (once a process; oneDNN asks too, where it
        # uses them). "" where the library was built for neither instruction set.
        self.packed_isa = _PACKED_ISAS[lib.mm_packed_isa()]  # which one packed_product runs on
        self.half_isa = _HALF_ISAS[lib.mm_half_isa()]  # which one half_product runs on ("": neither)
        self.path = path

    def start_helpers(self) -> bool:
        """Start the helper threads (``cpu_pool.c``) the parallel kernels share: this thread's torch
        thread count less one (itself), once a process; later calls add none. False if it failed."""
        wanted = max(0, torch.get_num_threads() - 1)
        ok = self._pool_start(wanted) == 0
        self.helpers = max(self.helpers, wanted if ok else 0)
        return ok


def rest_helpers() -> None:
    """Before a torch operator with threads of its own (OpenMP): the helper threads sleep now
    instead of spinning for the next kernel on the cores that operator's threads need."""
    lib = kernels()
    if lib is not None and lib.helpers:
        lib.pool_rest()


@cache
def kernels() -> Kernels | None:
    """The compiled kernels, or None where they cannot be built (or ``MMCACHE_CPU_KERNELS=0``)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler: the decoder's small operators run as eager PyTorch (slower)")
        return None
    try:
        return Kernels(_compile(compiler))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("CPU kernels not built, eager PyTorch instead: %s", str(detail)[:2000])
        return None


def usable(*tensors: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)) -> Kernels | None:
    """The kernels, where every tensor is a CPU tensor of ``dtypes`` (bfloat16: what every kernel
    takes; decode attention also takes a float32 cache)."""
    lib = kernels()
    if lib is None or any(t.device.type != "cpu" or t.dtype not in dtypes for t in tensors):
        return None
    return lib


def rms_norm(lib: Kernels, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, (dim,), weight, eps)`` for rows ``x`` (rows, dim), rows may be strided."""
    rows, dim = x.shape
    assert x.stride(1) == 1 and weight.is_contiguous()
    out = torch.empty((rows, dim), dtype=x.dtype)
    call = lib.rms_norm if x.dtype == torch.bfloat16 else lib.float32["rms_norm"]
    assert weight.dtype == x.dtype
    call(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), rows, dim, eps)
    return out


def rms_norm_or_eager(lib: Kernels | None, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm` where ``lib`` is given, else ``F.rms_norm`` (``weight`` 1-D)."""
    if lib is not None:
        return rms_norm(lib, x, weight, eps)
    return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)


def rotate_(lib: Kernels, x: torch.Tensor, cos: torch.Tensor, folded_sin: torch.Tensor) -> None:
    """Rotary embedding in place on ``x`` (rows, heads, head_dim), heads contiguous; ``cos`` and
    ``folded_sin`` (rows, head_dim) contiguous."""
    rows, heads, dim = x.shape
    assert x.stride(2) == 1 and x.stride(1) == dim and cos.is_contiguous() and folded_sin.is_contiguous()
    call = lib.rotate if x.dtype == torch.bfloat16 else lib.float32["rotate"]
    assert cos.dtype == folded_sin.dtype == x.dtype
    call(x.data_ptr(), x.stride(0), rows, heads, dim, cos.data_ptr(), folded_sin.data_ptr())


def silu_mul(lib: Kernels, gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` = [gate | up] (rows, 2 * width), contiguous."""
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    assert gate_up.is_contiguous()
    out = torch.empty((rows, width), dtype=gate_up.dtype)
    call = lib.silu_mul if gate_up.dtype == torch.bfloat16 else lib.float32["silu_mul"]
    call(gate_up.data_ptr(), out.data_ptr(), rows, width)
    return out


def rotate_vision(lib: Kernels, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb_vision`` for one of q, k: ``x`` (rows, heads, head_dim)
    bfloat16 or float32 with its last dimension contiguous, ``cos``/``sin`` (rows, head_dim) float32
    contiguous; a new contiguous tensor of ``x``'s type, bit for bit the reference's."""
    rows, heads, dim = x.shape
    assert x.stride(2) == 1 and cos.is_contiguous() and sin.is_contiguous()
    out = torch.empty((rows, heads, dim), dtype=x.dtype)
    call = lib.rotate_vision if x.dtype == torch.bfloat16 else lib.float32["rotate_vision"]
    call(
        x.data_ptr(),
        x.stride(0),
        x.stride(1),
        rows,
        heads,
        dim,
        cos.data_ptr(),
        sin.data_ptr(),
        out.data_ptr(),
    )
    return out


PREFILL_HEAD_DIMS = (16, 32, 64, 128)  # the head sizes mm_prefill_attention is built for


def prefill_attention(
    lib: Kernels,
    q: torch.Tensor,
    cache: torch.Tensor,
    table: torch.Tensor,
    start: int,
    kv_heads: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one sequence's query rows ``q`` (rows, heads, head_dim), the tokens
    ``start`` .. ``start + rows - 1``, over the cache ``cache`` (blocks, block_size, 2 * kv_heads,
    head_dim) through ``table`` (int64 block ids covering tokens 0 .. start + rows - 1), whose slots
    hold these rows' K/V already: a new (rows, heads, head_dim) tensor. ``q``'s heads contiguous;
    bfloat16 or float32 like the cache."""
    rows, heads, dim = q.shape
    size = cache.shape[1]
    assert q.stride(2) == 1 and q.stride(1) == dim and cache.is_contiguous() and q.dtype == cache.dtype
    assert dim in PREFILL_HEAD_DIMS and table.dtype == torch.int64 and table.shape[0] * size >= start + rows
    out = torch.empty((rows, heads, dim), dtype=q.dtype)
    call = lib.prefill_attention if q.dtype == torch.bfloat16 else lib.prefill_attention_f32
    slot = 2 * kv_heads * dim  # a cache slot: kv_heads keys, then kv_heads values
    keys, values = cache.data_ptr(), cache.data_ptr() + kv_heads * dim * cache.element_size()
    q_rows, table_ids = q.stride(0), table.data_ptr()
    call(q.data_ptr(), q_rows, keys, slot, values, slot, size, table_ids, rows, start, out.data_ptr(), heads,
         kv_heads, dim, scale)  # fmt: skip
    if lib.helpers:
        lib.pool_rest()  # torch's own threaded operators come next
    return out


def vision_attention(
    lib: Kernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of every row of one vision item over all of its rows (no mask): ``q``, ``k``,
    ``v`` (n, heads, head_dim), bfloat16 or float32, each head's values contiguous, rows any
    stride; a new (n, heads, head_dim) tensor. head_dim a multiple of 16."""
    n, heads, dim = q.shape
    for t in (q, k, v):
        assert t.shape == q.shape and t.dtype == q.dtype and t.stride(2) == 1 and t.stride(1) == dim
    assert dim % 16 == 0
    out = torch.empty((n, heads, dim), dtype=q.dtype)
    call = lib.vision_attention if q.dtype == torch.bfloat16 else lib.vision_attention_f32
    rows = (q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0))
    call(*rows, n, heads, dim, scale, out.data_ptr())
    return out


PACKED_ROWS = 64  # rows mm_packed_product takes (the weights read once from memory); above, oneDNN


def packed_product(
    lib: Kernels,
    x: torch.Tensor,
    weight: int,
    n: int,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    chunk: int = 0,
) -> torch.Tensor:
    """``x @ W.T + bias + residual``, rounded once to bfloat16, for rows ``x`` (rows <= PACKED_ROWS,
    k) bfloat16 with its last dimension contiguous; ``weight`` the address of oneDNN's packed
    bfloat16 ``W`` (n, k) (``cpu_packed.c`` says which layout), ``bias`` (n,) and ``residual``
    (rows, n) contiguous bfloat16 or None; ``chunk`` the input pairs of a partial sum on AVX512-BF16
    (0: one sum)."""
    rows, k = x.shape
    assert rows <= PACKED_ROWS and x.stride(1) == 1
    out = torch.empty((rows, n), dtype=torch.bfloat16)
    lib.packed_product(
        x.data_ptr(),
        x.stride(0),
        rows,
        weight,
        n,
        k,
        None if bias is None else bias.data_ptr(),
        None if residual is None else residual.data_ptr(),
        out.data_ptr(),
        chunk,
    )
    return out
