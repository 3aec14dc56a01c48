import pytest
import torch
import torch.nn.functional as F

from mmcache.llm_stage.linear import Projection, packing_supported
from mmcache.llm_stage.text_model import TextLM
from mmcache.shared.checkpoint import ModelSpec, load_weights, text_weight_name

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


def test_a_bf16_model_keeps_one_copy_of_each_weight_and_computes_what_the_checkpoint_says(tiny_models):
    spec = ModelSpec.load(tiny_models["qwen2-vl"])
    lm = TextLM(spec, torch.device("cpu"), torch.bfloat16)
    state = {k: v.to(torch.bfloat16) for k, v in load_weights(spec.path, text_weight_name).items()}
    x = torch.randn(7, lm.config.hidden_size, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    for i, w in enumerate(lm.fused):
        assert w.qkv.packed == w.down.packed == CPU_BF16
        pre = f"model.layers.{i}."
        qkv = [state[f"{pre}self_attn.{n}_proj.weight"] for n in "qkv"]
        bias = [state[f"{pre}self_attn.{n}_proj.bias"] for n in "qkv"]
        assert torch.equal(w.qkv(x), F.linear(x, torch.cat(qkv), torch.cat(bias)))
        gate_up = torch.cat([state[f"{pre}mlp.gate_proj.weight"], state[f"{pre}mlp.up_proj.weight"]])
        assert torch.equal(w.gate_up(x), F.linear(x, gate_up))
    if CPU_BF16:  # the modules' linears gave their weights up: one copy of each
        layer = lm.layers[0]
        assert layer.self_attn.q_proj.weight.numel() == 0 and layer.mlp.down_proj.weight.numel() == 0
    norm = lm.model.norm
    head = state.get("lm_head.weight", state["model.embed_tokens.weight"])
    want = F.linear(F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon), head).float()
    assert torch.equal(lm.logits(x), want)
    params = sum(v.numel() for k, v in state.items() if "proj" in k and k.endswith("weight"))
    assert lm.step_parameters() == params + head.numel()
