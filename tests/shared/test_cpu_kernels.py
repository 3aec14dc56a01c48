"""The compiled CPU kernels against eager PyTorch, and each row alone against the same row in a batch.

A cache hit computes fewer rows than a miss; the answer stays the same only if a row's result does
not depend on its neighbours. Eager PyTorch is the reference for the values: the rotary embedding
must equal it bit for bit (same roundings), the others sum in another order and may differ by one
bfloat16 rounding, on few values.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mmcache.llm_stage.attention import SdpaBackend, SdpaPlan
from mmcache.llm_stage.model_runner import rotate_
from mmcache.shared import cpu_kernels

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def lib() -> cpu_kernels.Kernels:
    built = cpu_kernels.kernels()
    assert built is not None, "the kernels must build where a C compiler is installed (scripts/setup)"
    return built


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bfloat16 steps (same-sign values)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("rows", [1, 7, 600])  # 600 x 896 crosses the threshold for threads
def test_rms_norm_is_eager_up_to_one_rounding_and_rows_are_independent(lib, rows: int) -> None:
    x = (torch.randn(rows, 896, generator=_gen(rows)) * 3).to(BF16)
    weight = torch.randn(896, generator=_gen(1)).to(BF16)
    ours = cpu_kernels.rms_norm(lib, x, weight, 1e-6)
    eager = F.rms_norm(x, (896,), weight, 1e-6)
    assert _ulps(ours, eager).max() <= 1
    assert (ours != eager).float().mean() < 0.01
    alone = cpu_kernels.rms_norm(lib, x[-1:].clone(), weight, 1e-6)
    assert torch.equal(alone, ours[-1:])


def test_rms_norm_reads_strided_rows(lib) -> None:
    wide = torch.randn(5, 1000, generator=_gen(2)).to(BF16)
    weight = torch.randn(896, generator=_gen(3)).to(BF16)
    view = wide[:, :896]
    assert torch.equal(
        cpu_kernels.rms_norm(lib, view, weight, 1e-6),
        cpu_kernels.rms_norm(lib, view.contiguous(), weight, 1e-6),
    )


@pytest.mark.parametrize("rows", [1, 9, 300])
def test_rotary_embedding_equals_eager_bit_for_bit(lib, rows: int) -> None:
    heads, kv_heads, dim = 14, 2, 64
    qkv = torch.randn(rows, heads + 2 * kv_heads, dim, generator=_gen(rows)).to(BF16)
    cos = torch.randn(rows, dim, generator=_gen(4)).to(BF16)
    folded_sin = torch.randn(rows, dim, generator=_gen(5)).to(BF16)
    eager, ours = qkv.clone(), qkv.clone()
    rotate_(eager[:, : heads + kv_heads], cos[:, None], folded_sin[:, None])
    cpu_kernels.rotate_(lib, ours[:, : heads + kv_heads], cos, folded_sin)
    assert torch.equal(ours, eager)  # the values, and v (not rotated) untouched
    assert not torch.equal(ours, qkv)


@pytest.mark.parametrize("rows", [1, 5, 40])  # 40 x 4864 crosses the threshold for threads
def test_silu_times_up_is_eager_up_to_one_rounding_and_rows_are_independent(lib, rows: int) -> None:
    gate_up = (torch.randn(rows, 2 * 4864, generator=_gen(rows)) * 4).to(BF16)
    gate, up = gate_up.chunk(2, dim=-1)
    ours = cpu_kernels.silu_mul(lib, gate_up)
    eager = F.silu(gate) * up
    assert _ulps(ours, eager).max() <= 1
    assert (ours != eager).float().mean() < 0.001
    assert torch.equal(cpu_kernels.silu_mul(lib, gate_up[:1].clone()), ours[:1])


class _Cache:
    """What SdpaBackend reads of a KV cache: blocks of one layer, their size and kv heads."""

    def __init__(self, blocks: torch.Tensor):
        self.kv = blocks[None]
        self.block_size = blocks.shape[1]
        self.num_kv_heads = blocks.shape[2] // 2

    def blocks(self, layer: int) -> torch.Tensor:
        return self.kv[layer]


def _plan(tables: list[list[int]], ends: list[int]) -> SdpaPlan:
    widest = max(len(t) for t in tables)
    plan = SdpaPlan(torch.empty(0, dtype=torch.long), [])
    plan.decode_blocks = torch.tensor([b for t in tables for b in t + [0] * (widest - len(t))])
    plan.decode_length = max(ends)
    plan.decode_ends = torch.tensor(ends)
    cols = torch.arange(plan.decode_length)
    plan.decode_blocked = (cols[None, :] >= plan.decode_ends[:, None])[:, None, None]
    return plan


@pytest.mark.parametrize("batch,length", [(3, 70), (9, 1100)])  # the second runs on threads
@pytest.mark.parametrize("dtype,dim", [(BF16, 64), (BF16, 128), (torch.float32, 32)])  # tiny's float32: 32
# groups of 7 (mid), 17 (more query heads than one pass of the AVX512-BF16 kernel takes) and 1
@pytest.mark.parametrize("heads,kv_heads", [(14, 2), (17, 1), (4, 4)])
def test_decode_attention_matches_the_float32_products_and_rows_are_independent(
    lib, batch: int, length: int, dtype: torch.dtype, dim: int, heads: int, kv_heads: int
) -> None:
    size = 16
    per_seq = -(-length // size)
    blocks = torch.randn(batch * per_seq + 1, size, 2 * kv_heads, dim, generator=_gen(6)).to(dtype)
    backend = SdpaBackend(_Cache(blocks), heads, dim**-0.5)  # type: ignore[arg-type]
    perm = torch.randperm(batch * per_seq, generator=_gen(7)) + 1  # scattered blocks, block 0 unused
    tables = [perm[i * per_seq : (i + 1) * per_seq].tolist() for i in range(batch)]
    ends = [length - 13 * i for i in range(batch)]  # different lengths: padded, masked tables
    q = torch.randn(batch, heads + 2 * kv_heads, dim, generator=_gen(8)).to(dtype)[:, :heads]
    plan = _plan(tables, ends)
    ours = backend._decode_kernel(lib, 0, q, plan)
    reference = backend._decode_attention(0, q, plan)
    if dtype == BF16:
        torch.testing.assert_close(ours.float(), reference.float(), atol=2e-2, rtol=2e-2)
        assert _ulps(ours, reference).float().mean() < 0.5
    else:  # float32 throughout: the sums in another order, the exp a polynomial of ~1 ulp
        torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    for i in (0, batch - 1):
        alone = backend._decode_kernel(lib, 0, q[i : i + 1].contiguous(), _plan([tables[i]], [ends[i]]))
        assert torch.equal(alone, ours[i : i + 1])


def test_kernels_can_be_switched_off_and_take_only_bfloat16_cpu_tensors(lib) -> None:
    assert cpu_kernels.usable(torch.zeros(2, dtype=BF16)) is lib
    assert cpu_kernels.usable(torch.zeros(2, dtype=BF16), torch.zeros(2)) is None  # float32
    both = (BF16, torch.float32)  # what decode attention takes
    assert cpu_kernels.usable(torch.zeros(2), dtypes=both) is lib
    assert cpu_kernels.usable(torch.zeros(2, dtype=torch.float16), dtypes=both) is None
    script = "from mmcache.shared import cpu_kernels; print(cpu_kernels.kernels())"
    off = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, cpu_kernels.ENV_SWITCH: "0"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert off.stdout.strip() == "None"


def test_a_missing_compiler_leaves_eager_pytorch_with_a_warning(tmp_path) -> None:
    script = (
        "import logging; logging.basicConfig()\n"
        "from mmcache.shared import cpu_kernels; print(cpu_kernels.kernels())"
    )
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "MMCACHE_HOME": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "None"
    assert "eager PyTorch" in run.stderr


def test_every_kernel_source_ships_with_the_package() -> None:
    """A wheel carries only the package data pyproject.toml lists: a source or header missing there
    compiles nowhere but in a checkout."""
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    listed = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]
    assert {p.name for p in cpu_kernels.SOURCES + cpu_kernels.HEADERS} <= set(listed["mmcache.shared"])
