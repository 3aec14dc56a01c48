"""The engine on the ``mid`` checkpoint (Qwen2-0.5B's text shape, 24 layers): greedy output equals HF
``generate`` in float32, with a text prompt and with an image, and in bfloat16 against HF in bfloat16.

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


def test_mid_greedy_equals_hf_generate_in_bfloat16(mid_env: Env) -> None:
    prompt = make_prompt(mid_env, TEXT)
    engine = make_engine(mid_env, num_kv_blocks=32, dtype="bfloat16")
    sampling = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    got = run(engine, [make_seq(mid_env, engine, 1, prompt, sampling)])[1][0]
    hf = AutoModelForImageTextToText.from_pretrained(mid_env.path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        out = hf.generate(**prompt.hf_inputs, max_new_tokens=MAX_NEW, do_sample=False)
    want = out[0, len(prompt.token_ids) :].tolist()
    assert got == want
