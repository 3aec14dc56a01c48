"""The engine on the ``mid`` checkpoint (Qwen2-0.5B's text shape, 24 layers): greedy output equals HF
``generate`` in float32, with a text prompt and with an image; in bfloat16 each greedy token is one
HF in bfloat16 would choose, up to the rounding bfloat16 itself brings.

At this size numerics accumulate over 24 layers and prefill runs through the MLP-bound path a served
model takes, which the 4-layer tiny checkpoint does not show.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from mmcache.encoder_stage.vision import VisionTower
from mmcache.processor.preprocess import Preprocessor
from mmcache.shared.checkpoint import ModelSpec
from mmcache.shared.messages import SamplingParams
from tests.llm_stage.test_engine import Env, hf_greedy, make_engine, make_prompt, make_seq, run

MAX_NEW = 8
TEXT = "Describe the harbor at dawn, the boats and the gulls over the water."


@pytest.fixture(scope="module")
def mid_env(mid_model) -> Env:
    spec = ModelSpec.load(mid_model)
    return Env(
        "qwen2-vl",
        mid_model,
        spec,
        AutoProcessor.from_pretrained(mid_model),
        AutoModelForImageTextToText.from_pretrained(mid_model, dtype=torch.float32).eval(),
        Preprocessor(str(mid_model), video_fps=2.0, max_video_frames=64),
        VisionTower(spec, device="cpu", dtype="float32"),
    )


@pytest.mark.parametrize("images", [(), ((224, 168, 5),)], ids=["text", "image"])
def test_mid_greedy_equals_hf_generate_in_float32(mid_env: Env, images) -> None:
    prompt = make_prompt(mid_env, TEXT, list(images))
    engine = make_engine(mid_env, num_kv_blocks=32)
    sampling = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    out = run(engine, [make_seq(mid_env, engine, 1, prompt, sampling)])
    want = hf_greedy(mid_env, prompt, MAX_NEW)
    assert len(want) == MAX_NEW and out[1][0] == want


def test_mid_bfloat16_tokens_are_hf_bfloat16_choices_up_to_bfloat16_rounding(mid_env: Env) -> None:
    """Decode attention runs in float32 over the bfloat16 cache (HF's fused kernel rounds the
    probabilities to bfloat16 first), so the two may part at a near tie; never by more than that.

    HF scores the engine's text (teacher forcing) in bfloat16 and float32: at every position the
    engine's token has a bfloat16 logit within twice bfloat16's own error (the largest bfloat16 vs
    float32 logit difference over these positions) of the best one, and the first token, which
    prefill computes through the same kernels as HF, is HF's.
    """
    prompt = make_prompt(mid_env, TEXT)
    engine = make_engine(mid_env, num_kv_blocks=32, dtype="bfloat16")
    sampling = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    got = run(engine, [make_seq(mid_env, engine, 1, prompt, sampling)])[1][0]
    ids = torch.tensor([prompt.token_ids + got])
    scored = slice(len(prompt.token_ids) - 1, -1)  # the logits that chose each generated token
    hf16 = AutoModelForImageTextToText.from_pretrained(mid_env.path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        bf16 = hf16(input_ids=ids).logits[0, scored].float()
        fp32 = mid_env.hf_model(input_ids=ids).logits[0, scored].float()
    noise = (bf16 - fp32).abs().max()
    behind = bf16.max(dim=-1).values - bf16.gather(1, torch.tensor(got)[:, None])[:, 0]
    assert got[0] == int(bf16[0].argmax())
    assert bool((behind <= 2 * noise).all()), (behind, noise)
