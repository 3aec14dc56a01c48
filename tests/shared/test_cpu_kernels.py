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


@pytest.mark.parametrize("rows", [1, 300])
def test_float32_operators_match_eager_float32(lib, rows: int) -> None:
    """A float32 model's layer takes the same operators on float32 rows: the rotary embedding bit for
    bit, the RMSNorm and SiLU within float32 roundings; a row alone equals it among many."""
    heads, kv_heads, dim = 4, 2, 32
    x = torch.randn(rows, 128, generator=_gen(rows)) * 3
    weight = torch.randn(128, generator=_gen(1))
    ours = cpu_kernels.rms_norm(lib, x, weight, 1e-6)
    torch.testing.assert_close(ours, F.rms_norm(x, (128,), weight, 1e-6), atol=1e-5, rtol=1e-5)
    assert torch.equal(cpu_kernels.rms_norm(lib, x[-1:].clone(), weight, 1e-6), ours[-1:])
    qkv = torch.randn(rows, heads + 2 * kv_heads, dim, generator=_gen(2))
    cos, folded_sin = torch.randn(rows, dim, generator=_gen(3)), torch.randn(rows, dim, generator=_gen(4))
    eager, rotated = qkv.clone(), qkv.clone()
    rotate_(eager[:, : heads + kv_heads], cos[:, None], folded_sin[:, None])
    cpu_kernels.rotate_(lib, rotated[:, : heads + kv_heads], cos, folded_sin)
    assert torch.equal(rotated, eager) and not torch.equal(rotated, qkv)
    gate_up = torch.randn(rows, 2 * 256, generator=_gen(5)) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    act = cpu_kernels.silu_mul(lib, gate_up)
    torch.testing.assert_close(act, F.silu(gate) * up, atol=1e-5, rtol=1e-5)
    assert torch.equal(cpu_kernels.silu_mul(lib, gate_up[-1:].clone()), act[-1:])


def _prefill_reference(
    q: torch.Tensor, blocks: torch.Tensor, table: list[int], start: int, kv_heads: int
) -> torch.Tensor:
    """Causal attention in float64: row r of q sees the cached tokens 0 .. start + r."""
    rows, _, dim = q.shape
    kv = blocks[table].flatten(0, 1)[: start + rows].double()
    allowed = torch.arange(start + rows)[None, :] <= start + torch.arange(rows)[:, None]
    out = F.scaled_dot_product_attention(
        q.double().transpose(0, 1)[None],
        kv[:, :kv_heads].transpose(0, 1)[None],
        kv[:, kv_heads:].transpose(0, 1)[None],
        attn_mask=allowed,
        scale=dim**-0.5,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


# tiny's float32 heads (32 wide), mid's bfloat16 ones (groups of 7), 128- and 16-wide ones; a prompt's
# first rows (start 0), a chunk after 150 cached tokens, and fewer rows than a task's block
@pytest.mark.parametrize(
    "dtype,dim,heads,kv_heads",
    [
        (torch.float32, 32, 4, 2),
        (BF16, 64, 14, 2),
        (BF16, 128, 8, 8),
        (torch.float32, 64, 3, 1),
        (BF16, 16, 4, 4),
    ],
)
@pytest.mark.parametrize("rows,start", [(220, 0), (100, 150), (3, 0), (1, 40)])
def test_prefill_attention_is_causal_attention_over_the_paged_cache(
    lib, dtype: torch.dtype, dim: int, heads: int, kv_heads: int, rows: int, start: int
) -> None:
    size, total = 16, start + rows
    per_seq = -(-total // size)
    blocks = torch.randn(per_seq + 3, size, 2 * kv_heads, dim, generator=_gen(9)).to(dtype)
    table = (torch.randperm(per_seq + 3, generator=_gen(10))[:per_seq]).tolist()  # scattered blocks
    q = torch.randn(rows, heads + 2 * kv_heads, dim, generator=_gen(11)).to(dtype)[:, :heads]
    ours = cpu_kernels.prefill_attention(lib, q, blocks, torch.tensor(table), start, kv_heads, dim**-0.5)
    reference = _prefill_reference(q, blocks, table, start, kv_heads)
    if dtype == BF16:  # one rounding of the float32 result to bfloat16
        torch.testing.assert_close(ours.double(), reference, atol=1e-2, rtol=1e-2)
    else:
        torch.testing.assert_close(ours.double(), reference, atol=2e-6, rtol=1e-5)
    # The same rows in chunks (a prompt over several steps, or after a prefix hit): bit for bit.
    cut = max(1, rows // 3)
    pieces = [
        cpu_kernels.prefill_attention(lib, q[:cut], blocks, torch.tensor(table), start, kv_heads, dim**-0.5),
        cpu_kernels.prefill_attention(
            lib, q[cut:], blocks, torch.tensor(table), start + cut, kv_heads, dim**-0.5
        ),
    ]
    assert torch.equal(torch.cat(pieces), ours)


# tiny's vision heads (16 wide), mid's (64 wide) and Qwen2-VL-2B's (80 wide); an item of one row, rows
# fewer than a task's block, a patch grid's 1024, and a count not a multiple of the 8 keys a pass scores
@pytest.mark.parametrize("dtype,dim,heads", [(torch.float32, 16, 4), (BF16, 64, 10), (torch.float32, 80, 3)])
@pytest.mark.parametrize("n", [1, 13, 1024, 301])
def test_vision_attention_is_unmasked_attention_within_the_item(
    lib, dtype: torch.dtype, dim: int, heads: int, n: int
) -> None:
    # q, k, v as a tower's qkv projection leaves them: views of one (n, 3, heads, dim) tensor
    q, k, v = (torch.randn(n, 3, heads, dim, generator=_gen(12)) * 2).to(dtype).unbind(1)
    ours = cpu_kernels.vision_attention(lib, q, k, v, dim**-0.5)
    reference = F.scaled_dot_product_attention(
        *(t.double().transpose(0, 1)[None] for t in (q, k, v)), scale=dim**-0.5
    )[0].transpose(0, 1)
    assert ours.shape == (n, heads, dim) and ours.dtype == dtype
    if dtype == BF16:  # one rounding of the float32 result to bfloat16
        torch.testing.assert_close(ours.double(), reference, atol=1e-2, rtol=1e-2)
    else:  # float32 sums over up to 1024 keys: as close as torch's own float32 attention, or closer
        heads_first = (t.transpose(0, 1)[None] for t in (q, k, v))
        torch_f32 = F.scaled_dot_product_attention(*heads_first, scale=dim**-0.5)
        torch_error = (torch_f32[0].transpose(0, 1).double() - reference).abs().max().item()
        assert (ours.double() - reference).abs().max().item() <= max(2 * torch_error, 1e-6)
    # A row's bits depend on its query and the item's keys and values alone, not on which rows
    # share its block: the queries in another order give the same rows in that order.
    order = torch.randperm(n, generator=_gen(13))
    assert torch.equal(cpu_kernels.vision_attention(lib, q[order], k, v, dim**-0.5), ours[order]) or n == 1


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
