"""The model runner's layer arithmetic against the transformers modules it replaces."""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb

from mmcache.llm_stage.model_runner import fold_sin, rotate_
from mmcache.llm_stage.text_model import TextLM, qk_norm_
from mmcache.shared.checkpoint import ModelSpec


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
