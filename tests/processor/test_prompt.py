"""Prompt building: piecewise (cached) tokenization equals whole-text tokenization; spans."""

from __future__ import annotations

import random

import numpy as np
import pytest

from mmcache.processor.prompt import PromptBuilder
from mmcache.shared.checkpoint import ModelSpec


@pytest.fixture(scope="module")
def builder(tiny_model) -> PromptBuilder:
    return PromptBuilder(ModelSpec.load(tiny_model))


def test_piecewise_encoding_equals_whole_encoding(builder):
    rng = random.Random(0)
    words = [
        "abc",
        "xyz",
        "héllo",
        "日本語",
        "🙂",
        "<|im_end|>",
        "<|im_start|>",
        "\n",
        "\t",
        "  ",
        ",",
        ".",
        "<|vision_start|>",
        "<|image_pad|>",
        "'",
        '"',
        "123",
        "system",
        "user\n",
        "<|endoftext|>",
    ]
    for _ in range(2000):
        text = "".join(rng.choice([*words, " "]) for _ in range(rng.randint(1, 60)))
        assert builder.encode(text) == builder.tokenizer.encode(text, add_special_tokens=False), text


def test_rendered_chats_encode_identically_and_reuse_pieces(builder):
    system = {"role": "system", "content": "You are a terse assistant. " * 50}
    for question in ("What is this?", "And now?", "Why?"):
        text = builder.render([system, {"role": "user", "content": question}])
        assert builder.encode(text) == builder.tokenizer.encode(text, add_special_tokens=False)
    info = builder._encode_piece.cache_info()
    assert info.hits >= 2  # the system prompt's piece was tokenized once


def test_qwen3_video_prompt_equals_hf_processor(tiny_models):
    """A Qwen3-VL video expands to ``<t seconds>``, vision start, pads, vision end per chunk (the
    reference processor's text), with one single-chunk span per chunk; a longer recording keeps
    the leading chunks' tokens."""
    from transformers import AutoProcessor

    from mmcache.processor.media_decode import DecodedVideo
    from mmcache.processor.preprocess import Preprocessor
    from tests.hf_reference import hf_inputs
    from tests.media import decode_all_frames, video_bytes

    path = tiny_models["qwen3-vl"]
    spec = ModelSpec.load(path)
    builder = PromptBuilder(spec)
    pre = Preprocessor(str(path), video_fps=2.0, max_video_frames=64)
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]
    built = {}
    for n in (5, 8):
        frames = decode_all_frames(video_bytes(num_frames=n, width=224, height=224))
        layout = pre.video(DecodedVideo(np.stack(frames), 2.0), salt=None)
        ids, spans = builder.build(messages, [layout])
        assert ids == hf_inputs(path, messages, videos=[frames])["input_ids"][0].tolist()
        assert [s.chunk_keys for s in spans] == [[c.key] for c in layout.chunks]
        per_chunk = layout.num_tokens // len(layout.chunks)
        for span in spans:
            assert span.grid_thw == (1, *layout.grid_thw[1:]) and span.num_tokens == per_chunk
            assert ids[span.offset - 1] == spec.config["vision_start_token_id"]
            assert ids[span.offset + per_chunk] == spec.config["vision_end_token_id"]
        text = AutoProcessor.from_pretrained(path).tokenizer.decode(ids[: spans[0].offset])
        assert text.endswith("user\n<0.2 seconds><|vision_start|>")  # the wrapper is replaced whole
        built[n] = ids, spans
    (short, short_spans), (long, _) = built[5], built[8]
    # 5 frames: chunks (0, 1), (2, 3), (4, 4 padded); 8 frames share the first two exactly
    shared_end = short_spans[1].offset + short_spans[1].num_tokens + 1  # through the 2nd chunk's end
    assert long[:shared_end] == short[:shared_end]
    assert long[shared_end:][:8] != short[shared_end:][:8]  # "<2.2 seconds>" vs "<2.0 seconds>"
