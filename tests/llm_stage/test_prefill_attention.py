"""Prefill attention in one C call (``mm_prefill_attention``, shared/cpu_attention.c) in the engine:
every prefill chunk takes it, and what comes out is what torch's SDPA path gives: the same greedy
tokens in float32 for prompts alone, in chunks of 16 tokens and continued after a prefix hit; in
bfloat16 the same prefill logits up to bfloat16 roundings."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mmcache.shared import cpu_kernels
from tests.llm_stage.test_engine import (
    CONCURRENT,
    GREEDY,
    Env,
    build_env,
    make_engine,
    make_prompt,
    make_seq,
    run,
)

pytestmark = pytest.mark.skipif(cpu_kernels.kernels() is None, reason="needs the compiled kernels")


@pytest.fixture(scope="module")
def env(tiny_models) -> Env:
    return build_env("qwen2-vl", tiny_models)


@pytest.fixture
def calls(monkeypatch) -> list[int]:
    """The start (tokens before the chunk) of every call to the kernel."""
    seen: list[int] = []
    real = cpu_kernels.prefill_attention

    def counted(lib, q, cache, table, start, kv_heads, scale):
        seen.append(start)
        return real(lib, q, cache, table, start, kv_heads, scale)

    monkeypatch.setattr(cpu_kernels, "prefill_attention", counted)
    return seen


def _engine(env: Env, kernel: bool, **cfg):
    engine = make_engine(env, **cfg)
    assert engine.runner.attention.prefill_kernel  # on wherever the kernels are built
    engine.runner.attention.prefill_kernel = kernel
    return engine


def _generate(env: Env, chunk: int, kernel: bool) -> tuple[dict, int]:
    """Tokens of three prompts (text, an image, two images), then of each continued by 40 more
    tokens (its blocks cached: prefilled from the hit on), and the prompt tokens the cache served."""
    engine = _engine(env, kernel, max_num_batched_tokens=chunk)
    prompts = [make_prompt(env, text, images) for text, images, _ in CONCURRENT[2:5]]
    out = run(engine, [make_seq(env, engine, i, p, GREEDY) for i, p in enumerate(prompts)])
    longer = [dataclasses.replace(p, token_ids=p.token_ids + p.token_ids[-40:]) for p in prompts]
    out |= run(engine, [make_seq(env, engine, 10 + i, p, GREEDY) for i, p in enumerate(longer)])
    return out, engine.blocks.stats.hits


@pytest.mark.parametrize("chunk", [2048, 16], ids=["whole", "chunks-of-16"])
def test_float32_prefill_in_c_gives_sdpas_tokens(env: Env, chunk: int, calls: list[int]) -> None:
    ours, hits = _generate(env, chunk, kernel=True)
    assert calls and any(start > 0 for start in calls)  # fresh prompts, and chunks after cached tokens
    assert hits > 0  # the continued prompts hit the prefix cache
    used = len(calls)
    sdpa, sdpa_hits = _generate(env, chunk, kernel=False)
    assert len(calls) == used and sdpa_hits == hits  # the SDPA path does not call it
    assert ours == sdpa


def test_bfloat16_prefill_in_c_gives_sdpas_logits(env: Env, calls: list[int]) -> None:
    prompt = make_prompt(env, *CONCURRENT[4][:2])  # two images and a question
    logits = []
    for kernel in (True, False):
        engine = _engine(env, kernel, dtype="bfloat16")
        forward = engine.runner.forward
        engine.runner.forward = lambda items, f=forward: (got := f(items), logits.append(got[0].clone()))[0]
        engine.submit(make_seq(env, engine, 0, prompt, dataclasses.replace(GREEDY, max_tokens=1)))
        engine.step()
    assert len(calls) == len(engine.lm.fused)  # one call a layer, with the kernel only
    ours, sdpa = logits
    assert ours.shape == sdpa.shape and (ours - sdpa).abs().max() < 0.05 * sdpa.abs().max()
    assert torch.equal(ours.argmax(-1), sdpa.argmax(-1))
