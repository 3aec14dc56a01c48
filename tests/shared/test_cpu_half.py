"""``cpu_half.c``: float16 weights, float32 rows and sums, one order for a row whatever its batch.

A bfloat16 checkpoint served in float32 (a CPU without bfloat16 instructions) multiplies by its
weights in float16 (exact after a power-of-two scale, ``shared/linear.py``). A cache hit computes
fewer rows than a miss: a row's output must not depend on the rows beside it.
"""

from __future__ import annotations

import pytest
import torch

from mmcache.shared import cpu_half, cpu_kernels
from mmcache.shared.linear import Projection

LIB = cpu_kernels.kernels()
pytestmark = pytest.mark.skipif(
    LIB is None or not LIB.half_isa, reason="needs the compiled kernels on AVX2 with F16C or on AVX-512"
)

# (outputs, inputs): one panel; one group; a partial group; inputs over one block and not a multiple
# of anything; Qwen2-0.5B's MLP shapes
SHAPES = [(16, 8), (64, 96), (80, 1100), (896, 4864), (9728, 896)]


def _case(n: int, k: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen).half().float()
    return weight, torch.randn(rows, k, generator=gen)


@pytest.mark.parametrize("n,k", SHAPES)
def test_the_product_is_the_float32_product_of_the_weights(n, k):
    assert LIB is not None and LIB.start_helpers()
    weight, x = _case(n, k, 13, seed=n + k)
    got = cpu_half.half_product(LIB, x, cpu_half.half_panels(weight))
    exact = (x.double() @ weight.double().T).float()
    # float32 sums of k products: within a few roundings of the exact sum's magnitude
    bound = 4 * k * torch.finfo(torch.float32).eps * (x.abs().double() @ weight.abs().double().T).float()
    assert got.shape == (13, n) and ((got - exact).abs() <= bound).all()
    assert not torch.equal(got, torch.zeros_like(got))


@pytest.mark.parametrize("n,k", SHAPES)
def test_a_row_computes_the_same_bits_alone_and_in_any_batch(n, k):
    assert LIB is not None and LIB.start_helpers()
    weight, x = _case(n, k, 230, seed=3 * n + k)
    panels = cpu_half.half_panels(weight)
    whole = cpu_half.half_product(LIB, x, panels)
    for start, rows in [(0, 1), (7, 1), (5, 2), (11, 5), (13, 6), (17, 7), (20, 64), (1, 97), (0, 229)]:
        part = cpu_half.half_product(LIB, x[start : start + rows], panels)
        assert torch.equal(part, whole[start : start + rows]), (start, rows)
    strided = torch.zeros(230, k + 8)
    strided[:, 3 : 3 + k] = x  # rows of a wider tensor: the stride is honoured
    assert torch.equal(cpu_half.half_product(LIB, strided[:, 3 : 3 + k], panels), whole)


def test_scale_bias_and_residual_join_in_order_as_separate_operators_would():
    assert LIB is not None and LIB.start_helpers()
    weight, x = _case(96, 200, 9, seed=5)
    gen = torch.Generator().manual_seed(6)
    bias, residual = torch.randn(96, generator=gen), torch.randn(9, 96, generator=gen)
    panels = cpu_half.half_panels(weight)
    plain = cpu_half.half_product(LIB, x, panels)
    joined = cpu_half.half_product(LIB, x, panels, 0.25, bias, residual)
    assert torch.equal(joined, residual + (plain * 0.25 + bias))
    assert torch.equal(cpu_half.half_product(LIB, x, panels, 0.25), plain * 0.25)


def test_projections_of_bfloat16_values_in_float32_take_it_and_keep_rows_batch_invariant():
    gen = torch.Generator().manual_seed(7)
    weight = (torch.randn(192, 320, generator=gen) * 0.02).to(torch.bfloat16).float()
    bias = torch.randn(192, generator=gen)
    proj = Projection(weight, bias)
    assert proj.kind == "fp16" and proj.kernels is not None and proj.half_scale > 0
    assert proj.weight.dtype == torch.float16 and proj.nbytes == weight.numel() * 2
    x = torch.randn(40, 320, generator=gen)
    residual = torch.randn(40, 192, generator=gen)
    full, added = proj(x), proj.add_to(residual, x)
    torch.testing.assert_close(full, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert torch.equal(added, residual + full)
    for rows in (1, 3, 6, 7):
        assert torch.equal(proj(x[:rows]), full[:rows])
        assert torch.equal(proj.add_to(residual[:rows], x[:rows]), added[:rows])
    assert torch.equal(proj(x.view(4, 10, 320)), full.view(4, 10, 192))  # leading dimensions kept


def test_outputs_not_in_whole_panels_keep_fbgemm():
    gen = torch.Generator().manual_seed(8)
    weight = (torch.randn(100, 64, generator=gen) * 0.02).to(torch.bfloat16).float()
    proj = Projection(weight)
    assert proj.kernels is None
    assert proj.kind == ("fp16" if "fbgemm" in torch.backends.quantized.supported_engines else "dense")
