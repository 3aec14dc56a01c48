"""The vision towers' attention as one compiled kernel on a CPU (``mm_vision_attention``).

Every family's vision attention splits its batch into items (images, video frames, windows) and
attends within each, no mask, through transformers' attention interface. Its SDPA path on a CPU
runs flash attention whose score and value products are MKL matrix products with a head_dim-deep
inner dimension: for the 16-wide heads of the default tiny checkpoint most of that time is the
products' packing, and the attention was over half of a 448² image's tower time (2026-12-07, AMD
EPYC). :func:`mmcache.shared.cpu_kernels.vision_attention` computes it with the rows of a block in
vector lanes instead (on that AMD EPYC, 1.3-1.7x faster than SDPA for one 1024-patch image on one
thread, 16- and 64-wide heads, bfloat16 and float32).

:func:`register` adds it to transformers' attention functions as :data:`NAME`, which
:class:`~.vision.VisionTower` names as its config's attention (:func:`implementation`); it runs the
kernel while :func:`.tower_kernels.active` holds the kernels (inside the tower's own forward) and
the shapes fit, and transformers' SDPA otherwise. A row's result depends only on its
own item, so batching never changes an embedding (a cache hit returns the bits a miss computes).

On an Intel CPU the tower names SDPA instead: there torch's flash attention multiplies through
oneDNN and MKL, which are tuned for it (AMX tiles in bfloat16). On a 2-core Intel Xeon with AMX
(2026-12-07), one 1024-patch item of ``mid``'s 10 heads of 64, two threads: SDPA 5.2-5.5 ms
against the kernel's 19.7-20.5 in bfloat16, 13.5-14.0 against 18.4-19.6 in float32; the tiny
tower's 4 heads of 16, one thread: 3.2 against 4.2 ms (bfloat16), 4.0 against 4.0 (float32). On a
2-core Intel Xeon with AVX512-BF16 and no AMX (2026-12-07): SDPA 15.0 against 20.4-21.7 ms in
float32, the dtype a bfloat16 checkpoint's tower computes in there (:mod:`.vision`); in bfloat16
the kernel was the faster, 18.2-19.2 against 21.5.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from mmcache.encoder_stage import tower_kernels
from mmcache.shared import cpu_kernels
from mmcache.shared.torch_utils import cpu_vendor

NAME = "mmcache_cpu"
SDPA = "sdpa"  # transformers' name for torch's scaled_dot_product_attention


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``query``/``key``/``value`` (1, heads, n, head_dim) of one
    item; (1, n, heads, head_dim) out, as SDPA's."""
    lib = tower_kernels.current()
    if lib is None or not fits(query, key, value, attention_mask, dropout, is_causal):
        options = {"scaling": scaling, "dropout": dropout, "is_causal": is_causal, **kwargs}
        return sdpa_attention_forward(module, query, key, value, attention_mask, **options)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (n, heads, head_dim) views
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return cpu_kernels.vision_attention(lib, q, k, v, scale)[None], None


def fits(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    dropout: float,
    is_causal: bool | None,
) -> bool:
    """What the kernel takes: one item, no mask, no dropout, not causal, as many key as query heads,
    CPU bfloat16 or float32, head_dim a multiple of 16, each head's values contiguous."""
    tensors = (query, key, value)
    return (
        mask is None
        and not dropout
        and not is_causal
        and query.dim() == 4
        and query.shape[0] == 1
        and all(t.shape == query.shape and t.dtype == query.dtype and t.device.type == "cpu" for t in tensors)
        and query.dtype in (torch.bfloat16, torch.float32)
        and query.shape[-1] % 16 == 0
        and all(t.stride(3) == 1 and t.stride(1) == t.shape[3] for t in tensors)
    )


def implementation(device: torch.device, vendor: str | None = None) -> str:
    """The attention a tower on ``device`` names in its config: the kernel (:data:`NAME`,
    registered) on a CPU other than Intel's (``vendor``: its ``vendor_id``, this machine's by
    default), :data:`SDPA` on an Intel CPU or a GPU. Decided by the machine, not by timing, so
    every replica on one kind of machine computes the same embeddings."""
    if device.type != "cpu" or (cpu_vendor() if vendor is None else vendor) == "GenuineIntel":
        return SDPA
    return register()


def register() -> str:
    """Add :func:`attention` to transformers' attention functions (idempotent); its name."""
    AttentionInterface.register(NAME, attention)
    return NAME
