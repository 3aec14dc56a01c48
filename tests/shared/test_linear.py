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
