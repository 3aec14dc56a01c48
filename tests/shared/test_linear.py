import pytest
import torch
import torch.nn.functional as F

from mmcache.shared.linear import PackedLinear, Projection, pack_linears, packing_supported

CPU_BF16 = packing_supported(torch.empty(1, dtype=torch.bfloat16))


@pytest.mark.parametrize("bias", [False, True])
def test_a_projection_equals_f_linear_bit_for_bit_for_one_row_and_for_many(bias):
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(300, 96, generator=gen).to(torch.bfloat16)
    b = torch.randn(300, generator=gen).to(torch.bfloat16) if bias else None
    proj = Projection(weight, b)
    assert proj.packed == CPU_BF16  # packed wherever the CPU has bfloat16 kernels
    x = torch.randn(37, 96, generator=gen).to(torch.bfloat16)
    want = F.linear(x, weight, b)
    assert torch.equal(proj(x), want)
    for rows in (1, 2, 16):
        assert torch.equal(proj(x[:rows]), F.linear(x[:rows], weight, b))


def test_float32_weights_stay_dense():
    weight = torch.randn(8, 4)
    proj = Projection(weight)
    assert not proj.packed and proj.weight is weight


def test_pack_linears_swaps_the_modules_that_pack_and_keeps_their_output():
    gen = torch.Generator().manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.GELU(), torch.nn.Linear(32, 8, bias=False))
    model = model.to(torch.bfloat16).eval()
    x = torch.randn(11, 64, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        want = model(x)
        assert pack_linears(model) == (2 if CPU_BF16 else 0)
        assert torch.equal(model(x), want)
    assert all(isinstance(m, PackedLinear) for m in (model[0], model[2])) == CPU_BF16


def _bf16_valued(rows: int, cols: int, seed: int) -> torch.Tensor:
    """A float32 weight holding bfloat16 values: a bfloat16 checkpoint served in float32."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=gen) * 0.02).to(torch.bfloat16).float()


HALF = "fbgemm" in torch.backends.quantized.supported_engines


@pytest.mark.skipif(not HALF, reason="this torch build has no FBGEMM")
@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_values_in_float32_run_on_half_weights_and_compute_the_float32_product(bias):
    weight = _bf16_valued(300, 96, seed=7)
    b = torch.randn(300, generator=torch.Generator().manual_seed(8)) if bias else None
    proj = Projection(weight, b)
    assert proj.kind == "fp16" and proj.packed
    assert proj.nbytes == weight.numel() * 2  # a step reads half the bytes of the float32 weight
    x = torch.randn(37, 96, generator=torch.Generator().manual_seed(9))
    for rows in (1, 2, 37):
        got, want = proj(x[:rows]), F.linear(x[:rows], weight, b)
        assert got.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # float32 sums, another order
    rounded = F.linear(x, weight.half().float(), b)  # what a plain float16 cast would have computed
    assert not torch.equal(proj(x), rounded) or torch.equal(weight.half().float(), weight)


@pytest.mark.skipif(not HALF, reason="this torch build has no FBGEMM")
def test_the_power_of_two_scale_keeps_values_outside_float16s_range_exact():
    weight = _bf16_valued(64, 32, seed=10)
    weight[0, 0] = float(torch.tensor(3.0e-6).to(torch.bfloat16))  # below float16's normal range:
    weight[1, 1] = -(2.0**-20)  # exact once scaled
    weight[2, 2] = 0.0
    proj = Projection(weight)
    assert proj.kind == "fp16" and proj.half_scale > 0
    x = torch.zeros(1, 32)
    x[0, 0] = 1.0
    assert proj(x)[0, 0] == weight[0, 0]  # one product, so no order of sums: the exact value back
    x[0, 0], x[0, 1] = 0.0, 1.0
    assert proj(x)[0, 1] == weight[1, 1]


@pytest.mark.parametrize(
    "spoil",
    [
        lambda w: w.add_(torch.randn(w.shape) * 1e-5),  # float32 values: 24 significant bits
        lambda w: w.__setitem__((0, 0), 1e-30),  # too small next to the rest even scaled
        lambda w: w.__setitem__((0, 0), float("inf")),
    ],
)
def test_weights_float16_cannot_hold_exactly_stay_dense(spoil):
    weight = _bf16_valued(64, 32, seed=11)
    spoil(weight)
    proj = Projection(weight)
    assert proj.kind == "dense" and proj.weight is weight


def test_the_half_layout_is_only_taken_where_allowed():
    weight = _bf16_valued(64, 32, seed=12)
    assert Projection(weight, half=False).kind == "dense"
    model = torch.nn.Sequential(torch.nn.Linear(32, 64))
    model[0].weight.data = weight.t().contiguous()
    assert pack_linears(model) == 0  # the vision tower's many-row products keep MKL's float32 kernel


@pytest.mark.skipif(not HALF, reason="this torch build has no FBGEMM")
def test_a_scale_folded_into_the_norm_before_or_the_sum_after_changes_no_bit():
    """The layer folds a half projection's scale into the norm's weight before it (``prescaled``) or
    into the residual addition after it (``add_to``): both exact, so the same bits as the plain call."""
    gen = torch.Generator().manual_seed(13)
    proj, biased = Projection(_bf16_valued(200, 64, seed=14)), Projection(_bf16_valued(200, 64, seed=15))
    biased.bias = torch.randn(200, generator=gen)
    assert proj.input_scale < 1.0  # the weights were scaled up, inputs come scaled down
    hidden, norm = torch.randn(9, 64, generator=gen) * 4, torch.randn(64, generator=gen)
    x = F.rms_norm(hidden, (64,), norm, 1e-6)
    folded = F.rms_norm(hidden, (64,), norm * proj.input_scale, 1e-6)
    assert torch.equal(folded, x * proj.input_scale)
    for p in (proj, biased):
        assert torch.equal(p.prescaled(x * p.input_scale), p(x))
    residual = torch.randn(9, 200, generator=gen)
    assert torch.equal(proj.add_to(residual, x), residual + proj(x))
    assert torch.equal(biased.add_to(residual, x), residual + biased(x))


@pytest.mark.skipif(not CPU_BF16, reason="this CPU has no bfloat16 kernels")
@pytest.mark.parametrize("bias", [False, True])
def test_on_onednn_the_residual_joins_the_sums_rounded_once_and_alike_for_any_row_count(bias):
    gen = torch.Generator().manual_seed(11)
    weight = (torch.randn(200, 96, generator=gen) * 0.05).to(torch.bfloat16)
    b = torch.randn(200, generator=gen).to(torch.bfloat16) if bias else None
    proj = Projection(weight, b)
    assert proj.kind == "onednn"
    x = torch.randn(33, 96, generator=gen).to(torch.bfloat16)
    residual = torch.randn(33, 200, generator=gen).to(torch.bfloat16)
    joined = proj.add_to(residual, x)
    assert torch.equal(proj.add_to(torch.zeros_like(residual), x), proj(x))  # nothing added: the product
    for rows in (1, 2, 17):
        assert torch.equal(proj.add_to(residual[:rows], x[:rows]), joined[:rows])
    # Against the float32 sum of the same bfloat16 values, one rounding: within half a unit of
    # bfloat16's last place (2**-8 relative), plus float32's differences in summation order.
    exact = residual.float() + F.linear(x.float(), weight.float(), None if b is None else b.float())
    assert ((joined.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-4).all()
    # and from eager (the product rounded, then the sum) by eager's extra rounding: half a unit of
    # the product's last place, carried into the sum's own rounding (one unit of the sum's at most)
    product = proj(x)
    eager = (residual + product).float()
    bound = product.float().abs() * 2**-8 + eager.abs() * 2**-7 + 1e-4
    assert ((joined.float() - eager).abs() <= bound).all()
    assert not torch.equal(joined.float(), eager)  # one rounding fewer shows somewhere
