"""A decode-only step's layers in one C call (llm_stage/cpu_decode.py, shared/cpu_layers.c) compute
what the Python layer loop computes, bit for bit: the same logits at every step, for one row and
for several, with text and image prompts, and with layers split between C and the loop; in
bfloat16 (oneDNN's packed weights) and in float32 (float16 weights, ``cpu_half.c``)."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import safetensors.torch
import torch

from mmcache.llm_stage.cpu_decode import CpuDecode
from mmcache.shared import cpu_kernels
from mmcache.shared.checkpoint import ModelSpec
from mmcache.shared.cpu_layers import DecodeLayers
from mmcache.shared.linear import packing_supported
from mmcache.shared.messages import SamplingParams
from tests.llm_stage.test_engine import CONCURRENT, Env, build_env, make_engine, make_prompt, make_seq

LIB = cpu_kernels.kernels()
PACKED = LIB is not None and bool(LIB.packed_isa) and packing_supported(torch.empty(1, dtype=torch.bfloat16))
needs_packed = pytest.mark.skipif(not PACKED, reason="needs AVX512-BF16 or AMX and the compiled kernels")
needs_half = pytest.mark.skipif(
    LIB is None or not LIB.half_isa, reason="needs AVX2 with F16C or AVX-512 and the compiled kernels"
)


@pytest.fixture(scope="module", params=["qwen2-vl", "qwen2.5-vl"])
def env(request, tiny_models) -> Env:
    return build_env(request.param, tiny_models)


@pytest.fixture(scope="module")
def half_env(env: Env, tmp_path_factory) -> Env:
    """``env``'s checkpoint with every weight rounded to a bfloat16 value, served in float32 (a
    bfloat16 checkpoint on a CPU without bfloat16 instructions): its projections take
    ``cpu_half.c``'s float16 weights."""
    path = tmp_path_factory.mktemp(f"bf16-valued-{env.arch}")
    shutil.copytree(env.path, path, dirs_exist_ok=True)
    weights = path / "model.safetensors"
    tensors = safetensors.torch.load_file(weights)
    rounded = {k: v.to(torch.bfloat16).to(v.dtype) for k, v in tensors.items() if v.is_floating_point()}
    safetensors.torch.save_file({**tensors, **rounded}, weights, metadata={"format": "pt"})
    return dataclasses.replace(env, path=path, spec=ModelSpec.load(path), cache={})


def _generate(
    env: Env, prompts, runs=None, use_c: bool = True, dtype: str = "bfloat16"
) -> tuple[list[torch.Tensor], int, int]:
    """Every step's logits of the prompts run together; C calls made; decode-only steps."""
    engine = make_engine(env, dtype=dtype)
    runner = engine.runner
    assert runner.cpu_decode is not None
    if runs is not None:
        runner.cpu_decode.runs = runs
    if not use_c:
        runner.cpu_decode = None
    logits: list[torch.Tensor] = []
    calls = decode_steps = 0
    forward, run_layers = runner.forward, DecodeLayers.run

    def recording_forward(items):
        nonlocal decode_steps
        decode_steps += all(it.num_tokens == 1 and it.start > 0 for it in items)
        out = forward(items)
        logits.append(out[0].clone())
        return out

    def counting_run(self, *args):
        nonlocal calls
        calls += 1
        return run_layers(self, *args)

    runner.forward = recording_forward
    DecodeLayers.run = counting_run  # type: ignore[method-assign]
    try:
        for i, (prompt, n) in enumerate(prompts):
            sampling = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            engine.submit(make_seq(env, engine, i, prompt, sampling))
        while engine.has_work():
            engine.step()
    finally:
        DecodeLayers.run = run_layers  # type: ignore[method-assign]
    return logits, calls, decode_steps


# bfloat16 on oneDNN's packed weights; float32 on cpu_half.c's float16 weights (a checkpoint of
# bfloat16 values: half_env)
DTYPES = [
    pytest.param("bfloat16", marks=needs_packed, id="bfloat16"),
    pytest.param("float32", marks=needs_half, id="float32"),
]


def _env_for(request, env: Env, dtype: str) -> Env:
    env = env if dtype == "bfloat16" else request.getfixturevalue("half_env")
    first = make_engine(env, dtype=dtype).lm.fused[0]
    kind = "onednn" if dtype == "bfloat16" else "fp16"
    assert all(p.kind == kind and p.kernels is not None for p in (first.qkv, first.down))
    return env


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("count", [1, 3], ids=["one-row", "three-rows"])
def test_c_layers_give_the_loops_logits_bit_for_bit(request, env: Env, dtype: str, count: int) -> None:
    env = _env_for(request, env, dtype)
    prompts = [(make_prompt(env, text, images), n) for text, images, n in CONCURRENT[2 : 2 + count]]
    ours, calls, decode_steps = _generate(env, prompts, dtype=dtype)
    loop, loop_calls, _ = _generate(env, prompts, use_c=False, dtype=dtype)
    assert decode_steps >= 5 and calls == decode_steps and loop_calls == 0  # every decode step ran in C
    assert len(ours) == len(loop) and all(torch.equal(a, b) for a, b in zip(ours, loop, strict=True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_layers_split_between_c_and_the_loop_give_the_same_logits(request, env: Env, dtype: str) -> None:
    env = _env_for(request, env, dtype)
    prompts = [(make_prompt(env, text, images), n) for text, images, n in CONCURRENT[3:5]]
    layers = len(make_engine(env, dtype=dtype).lm.fused)
    split = [(0, 1, True), (1, layers - 1, False), (layers - 1, layers, True)]
    ours, calls, decode_steps = _generate(env, prompts, runs=split, dtype=dtype)
    loop, _, _ = _generate(env, prompts, use_c=False, dtype=dtype)
    assert calls == 2 * decode_steps > 0
    assert all(torch.equal(a, b) for a, b in zip(ours, loop, strict=True))


@needs_packed
def test_layers_with_qk_norms_stay_in_the_loop(tiny_models) -> None:
    """Qwen3's per-head q/k norms are not among the C layer's operators: no layer qualifies."""
    qwen3 = build_env("qwen3-vl", tiny_models)
    engine = make_engine(qwen3, dtype="bfloat16")
    assert engine.runner.kernels is not None and engine.runner.cpu_decode is None
    assert CpuDecode.build(engine.lm, engine.kv, engine.runner.attention) is None


@needs_packed
def test_a_layer_whose_projection_stayed_on_onednn_runs_in_the_loop(env: Env) -> None:
    """The load-time probe may keep a weight on oneDNN (no packed kernel): that layer alone leaves C."""
    engine = make_engine(env, dtype="bfloat16")
    layers = len(engine.lm.fused)
    engine.lm.fused[1].o.kernels = None
    built = CpuDecode.build(engine.lm, engine.kv, engine.runner.attention)
    assert built is not None and built.runs == [(0, 1, True), (1, 2, False), (2, layers, True)]


def test_float32_weights_float16_cannot_hold_keep_the_loop(env: Env) -> None:
    """The tiny checkpoints' float32 weights are not float16 values: dense MKL products, no C layers."""
    engine = make_engine(env, dtype="float32")
    assert engine.lm.fused[0].qkv.kind == "dense" and engine.runner.cpu_decode is None
