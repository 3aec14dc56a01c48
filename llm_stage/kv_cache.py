"""The paged KV cache: K and V of every layer, in blocks of slots, and how big it may be."""

from __future__ import annotations

import torch

from mmcache.llm_stage.text_model import TextLM

CUDA_MEMORY_FRACTION = 0.9  # of the device memory left free once the weights are loaded
DEFAULT_CPU_GB = 0.5  # --kv-cache-gb when not given and not on CUDA


class KVCache:
    """K and V of every layer in one tensor: (layers, num_blocks * block_size, 2 * kv_heads, head_dim).

    A slot's row holds its K heads, then its V heads (one write and one gather serve both).
    """

    def __init__(
        self, lm: TextLM, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype
    ):
        shape = (len(lm.layers), num_blocks * block_size, 2 * lm.num_kv_heads, lm.head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.num_kv_heads = lm.num_kv_heads
        self.num_blocks = num_blocks
        self.block_size = block_size
        # NOTE: views of ``kv``, made once (attention asks for one every layer of every step); they
        # stay valid because ``kv`` is never replaced, only written in place.
        self._blocks = [layer.view(num_blocks, block_size, *shape[2:]) for layer in self.kv]

    def blocks(self, layer: int) -> torch.Tensor:
        """Layer ``layer`` as (num_blocks, block_size, 2 * kv_heads, head_dim)."""
        return self._blocks[layer]

    @staticmethod
    def bytes_per_block(lm: TextLM, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * len(lm.layers) * block_size * lm.num_kv_heads * lm.head_dim * itemsize


def kv_budget_bytes(kv_cache_gb: float, device: torch.device, free_bytes: int | None = None) -> int:
    """Bytes for the KV pool: ``--kv-cache-gb`` when given (> 0); else, on CUDA, a fraction of the
    device memory still free after the weights (``free_bytes``, read from the device when None);
    else :data:`DEFAULT_CPU_GB`."""
    if kv_cache_gb > 0:
        return int(kv_cache_gb * (1 << 30))
    if device.type == "cuda":
        if free_bytes is None:
            free_bytes, _ = torch.cuda.mem_get_info(device)
        return int(free_bytes * CUDA_MEMORY_FRACTION)
    return int(DEFAULT_CPU_GB * (1 << 30))
