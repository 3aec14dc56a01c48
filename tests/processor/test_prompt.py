"""Prompt building: piecewise (cached) tokenization equals whole-text tokenization; spans."""

from __future__ import annotations

import random

import pytest

from processor.prompt import PromptBuilder
from shared.checkpoint import ModelSpec


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
