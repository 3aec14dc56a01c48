"""The model runner's layer arithmetic against the transformers modules it replaces."""

from __future__ import annotations

import shutil
from dataclasses import replace

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb

from mmcache.llm_stage.model_runner import fold_sin, rotate_
from mmcache.llm_stage.text_model import TextLM, qk_norm_
from mmcache.shared.checkpoint import ModelSpec, load_weights, text_weight_name
from mmcache.shared.linear import packing_supported


def test_rotation_equals_the_reference_bit_for_bit(tiny_models):
    lm = TextLM(ModelSpec.load(tiny_models["qwen2-vl"]), torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(0)
    rows = 37
    positions = torch.randint(0, 5000, (3, rows), generator=gen)
    q = torch.randn(1, lm.num_heads, rows, lm.head_dim, generator=gen)
    k = torch.randn(1, lm.num_kv_heads, rows, lm.head_dim, generator=gen)
    cos, sin = lm.rope(q.new_empty(rows, 1), positions)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    qk = torch.cat([q[0], k[0]]).transpose(0, 1).contiguous()  # (rows, heads + kv_heads, head_dim)
    rotate_(qk, cos[0, :, None], fold_sin(sin)[0, :, None])
    assert torch.equal(qk[:, : lm.num_heads], want_q[0].transpose(0, 1))
    assert torch.equal(qk[:, lm.num_heads :], want_k[0].transpose(0, 1))


def test_fused_projections_share_the_modules_storage_and_compute_the_same(tiny_models):
    lm = TextLM(ModelSpec.load(tiny_models["qwen2.5-vl"]), torch.device("cpu"), torch.float32)
    x = torch.randn(9, lm.config.hidden_size, generator=torch.Generator().manual_seed(1))
    for layer, fused in zip(lm.layers, lm.fused, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        assert fused.gate_up is not None and not fused.qkv.packed  # float32 stays dense
        assert attn.q_proj.weight.data_ptr() == fused.qkv.weight.data_ptr()  # a view, not a second copy
        up = mlp.up_proj.weight.untyped_storage()
        assert up.data_ptr() == fused.gate_up.weight.untyped_storage().data_ptr()
        qkv = fused.qkv(x)
        separate = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
        torch.testing.assert_close(qkv, separate, rtol=1e-6, atol=1e-6)
        gate, up = fused.gate_up(x).chunk(2, dim=-1)
        torch.testing.assert_close(fused.act(gate) * up, mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))


def test_qwen3_qk_norm_equals_the_modules_bit_for_bit(tiny_models):
    lm = TextLM(ModelSpec.load(tiny_models["qwen3-vl"]), torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(2)
    rows, heads, kv_heads = 23, lm.num_heads, lm.num_kv_heads
    for layer, fused in zip(lm.layers, lm.fused, strict=True):
        attn = layer.self_attn
        assert fused.qkv.bias is None and fused.qk_norm is not None
        torch.nn.init.normal_(attn.q_norm.weight, generator=gen)  # not all ones, so the scale counts
        torch.nn.init.normal_(attn.k_norm.weight, generator=gen)
        fused = replace(
            fused,
            qk_norm=torch.cat(
                [attn.q_norm.weight.expand(heads, -1), attn.k_norm.weight.expand(kv_heads, -1)]
            ),
        )
        qk = torch.randn(rows, heads + kv_heads, lm.head_dim, generator=gen) * 3
        want_q, want_k = attn.q_norm(qk[:, :heads]), attn.k_norm(qk[:, heads:])
        qk_norm_(qk, fused.qk_norm, fused.qk_eps)
        assert torch.equal(qk[:, :heads], want_q) and torch.equal(qk[:, heads:], want_k)


def test_a_bf16_model_keeps_one_copy_of_each_weight_and_computes_what_the_checkpoint_says(tiny_models):
    packs = packing_supported(torch.empty(1, dtype=torch.bfloat16))
    spec = ModelSpec.load(tiny_models["qwen2-vl"])
    lm = TextLM(spec, torch.device("cpu"), torch.bfloat16)
    state = {k: v.to(torch.bfloat16) for k, v in load_weights(spec.path, text_weight_name).items()}
    x = torch.randn(7, lm.config.hidden_size, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    for i, w in enumerate(lm.fused):
        assert w.qkv.packed == w.down.packed == packs
        pre = f"model.layers.{i}."
        qkv = [state[f"{pre}self_attn.{n}_proj.weight"] for n in "qkv"]
        bias = [state[f"{pre}self_attn.{n}_proj.bias"] for n in "qkv"]
        assert torch.equal(w.qkv(x), F.linear(x, torch.cat(qkv), torch.cat(bias)))
        gate_up = torch.cat([state[f"{pre}mlp.gate_proj.weight"], state[f"{pre}mlp.up_proj.weight"]])
        assert torch.equal(w.gate_up(x), F.linear(x, gate_up))
    if packs:  # the modules' linears gave their weights up: one copy of each
        layer = lm.layers[0]
        for lin in (layer.self_attn.q_proj, layer.mlp.down_proj):  # not even a view of the dense one
            assert lin.weight.untyped_storage().nbytes() == 0
    norm = lm.model.norm
    head = state.get("lm_head.weight", state["model.embed_tokens.weight"])
    want = F.linear(F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon), head).float()
    assert torch.equal(lm.logits(x), want)
    params = sum(v.numel() for k, v in state.items() if "proj" in k and k.endswith("weight"))
    assert lm.step_parameters() == params + head.numel()


def test_a_bfloat16_checkpoint_in_float32_reads_half_weights_and_computes_its_values(tiny_models, tmp_path):
    """A bfloat16 checkpoint served in float32 (a CPU without bfloat16 kernels): its projections
    keep float16 weights (the checkpoint's values exactly), one copy each, half the bytes a step."""
    path = tmp_path / "bf16"
    shutil.copytree(tiny_models["qwen2-vl"], path)
    for file in path.glob("*.safetensors"):
        save_file(
            {k: v.to(torch.bfloat16) for k, v in load_file(file).items()}, file, metadata={"format": "pt"}
        )
    spec = ModelSpec.load(path)
    lm = TextLM(spec, torch.device("cpu"), torch.float32)
    half = "fbgemm" in torch.backends.quantized.supported_engines
    state = {k: v.float() for k, v in load_weights(spec.path, text_weight_name).items()}
    x = torch.randn(7, lm.config.hidden_size, generator=torch.Generator().manual_seed(6))
    for i, w in enumerate(lm.fused):
        assert w.gate_up is not None and w.down is not None
        for proj in (w.qkv, w.o, w.gate_up, w.down):
            assert proj.packed == half and proj.nbytes == proj.numel * (2 if half else 4)
        pre = f"model.layers.{i}."
        qkv = torch.cat([state[f"{pre}self_attn.{n}_proj.weight"] for n in "qkv"])
        bias = torch.cat([state[f"{pre}self_attn.{n}_proj.bias"] for n in "qkv"])
        torch.testing.assert_close(w.qkv(x), F.linear(x, qkv, bias), rtol=1e-5, atol=1e-6)
        gate_up = torch.cat([state[f"{pre}mlp.gate_proj.weight"], state[f"{pre}mlp.up_proj.weight"]])
        torch.testing.assert_close(w.gate_up(x), F.linear(x, gate_up), rtol=1e-5, atol=1e-6)
    if half:  # the modules gave their float32 weights up
        assert lm.layers[0].mlp.down_proj.weight.untyped_storage().nbytes() == 0
