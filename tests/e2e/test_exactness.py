"""Greedy output of ``mmcache serve`` equals plain transformers on the same checkpoint, token for token.

For every architecture, one server each (module scope), and prompts with no media,
images (several sizes, formats, an alpha channel), videos (even and odd frame
counts), several turns, ``data:`` and ``file://`` URLs. The prompt token ids must
equal the HF processor's ``input_ids`` and the generated ids HF ``generate``'s.
Every case is sent twice: the second answer comes from warm caches (processor,
encoder, KV prefix) and must not differ.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote, urlsplit

import numpy as np
import pytest
from PIL import Image

from tests import media
from tests.e2e.server import Server, serving
from tests.hf_reference import hf_generate, load

pytestmark = pytest.mark.e2e

ARCHS = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3-vl-moe")
MAX_TOKENS = 16


class Media:
    """The test media, as data URLs and as files under the server's allowed directory."""

    def __init__(self, root: Path):
        self.root = root
        self.png = media.image_bytes(448, 448, seed=0)
        self.jpeg = media.image_bytes(300, 200, seed=1, fmt="JPEG")
        self.video = media.video_bytes(8, 224, 224, fps=2, seed=2)  # 4 temporal chunks
        self.odd_video = media.video_bytes(5, 160, 120, fps=2, seed=3)  # 3 chunks, last one padded
        alpha = np.tile(np.arange(200, dtype=np.uint8), (280, 1))  # transparent left, opaque right
        rgba = np.dstack([media.image_array(200, 280, seed=4), alpha])
        buf = io.BytesIO()
        Image.fromarray(rgba, "RGBA").save(buf, format="PNG")
        self.rgba = buf.getvalue()
        (root / "photo.jpg").write_bytes(self.jpeg)
        (root / "clip.mp4").write_bytes(self.video)


@pytest.fixture(scope="module")
def mm(tmp_path_factory) -> Media:
    return Media(tmp_path_factory.mktemp("exact-media"))


@pytest.fixture(scope="module", params=ARCHS)
def served(request, tiny_models, mm):
    with serving(tiny_models[request.param], media_dir=mm.root) as server:
        yield server


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def video(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def user(*parts: dict) -> dict:
    return {"role": "user", "content": list(parts)}


CASES: dict[str, Callable[[Media], list[dict]]] = {
    "text_only": lambda m: [{"role": "user", "content": "Tell me a story about the sea and the stars."}],
    "one_image": lambda m: [user(image(media.data_url(m.png, "image/png")), text("Describe the picture."))],
    "two_images": lambda m: [
        user(
            text("Compare"),
            image(media.data_url(m.png, "image/png")),
            text("with"),
            image(media.data_url(m.jpeg, "image/jpeg")),
        )
    ],
    "one_video": lambda m: [user(video(media.data_url(m.video, "video/mp4")), text("What happens?"))],
    "odd_frame_video": lambda m: [user(text("Watch:"), video(media.data_url(m.odd_video, "video/mp4")))],
    "rgba_image": lambda m: [user(image(media.data_url(m.rgba, "image/png")), text("Any transparency?"))],
    "multi_turn": lambda m: [
        {"role": "system", "content": "You answer in one short sentence."},
        user(image(media.data_url(m.png, "image/png")), text("What colour dominates?")),
        {"role": "assistant", "content": "Mostly green, with some blue."},
        {"role": "user", "content": "And in the corners?"},
    ],
    "file_urls": lambda m: [
        user(
            image((m.root / "photo.jpg").as_uri()),
            video((m.root / "clip.mp4").as_uri()),
            text("Is the photo a frame of the clip?"),
        )
    ],
}


def _read(url: str) -> bytes:
    if url.startswith("data:"):
        return base64.b64decode(url.partition(",")[2])
    assert url.startswith("file://"), url
    return Path(unquote(urlsplit(url).path)).read_bytes()


def reference_inputs(messages: list[dict]) -> tuple[list[dict], list[bytes], list[list[np.ndarray]]]:
    """OpenAI-form messages → HF chat-template form, plus the images and decoded video frames."""
    hf_messages, images, videos = [], [], []
    for msg in messages:
        if isinstance(msg["content"], str):
            hf_messages.append(msg)
            continue
        parts = []
        for part in msg["content"]:
            if part["type"] == "text":
                parts.append(part)
            elif part["type"] == "image_url":
                images.append(_read(part["image_url"]["url"]))
                parts.append({"type": "image"})
            else:
                videos.append(media.decode_all_frames(_read(part["video_url"]["url"])))
                parts.append({"type": "video"})
        hf_messages.append({"role": msg["role"], "content": parts})
    return hf_messages, images, videos


def greedy(server: Server, messages: list[dict]) -> dict:
    status, body = server.post(
        "/v1/chat/completions",
        {
            "model": server.model.name,
            "messages": messages,
            "temperature": 0,
            "max_tokens": MAX_TOKENS,
            "return_token_ids": True,
        },
    )
    assert status == 200, body
    return body


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(served: Server, mm: Media, case: str) -> None:
    messages = CASES[case](mm)
    ref = hf_generate(served.model, *reference_inputs(messages), max_new_tokens=MAX_TOKENS)
    assert 1 <= len(ref.token_ids) <= MAX_TOKENS
    tokenizer = load(str(served.model))[0].tokenizer

    first = greedy(served, messages)
    again = greedy(served, messages)  # every cache tier is warm now
    for body in (first, again):
        choice = body["choices"][0]
        assert body["prompt_token_ids"] == ref.prompt_token_ids
        assert choice["token_ids"] == ref.token_ids
        assert choice["message"]["content"] == tokenizer.decode(ref.token_ids, skip_special_tokens=True)
        assert choice["finish_reason"] == ("length" if len(ref.token_ids) == MAX_TOKENS else "stop")
        usage = body["usage"]
        assert usage["prompt_tokens"] == len(ref.prompt_token_ids)
        assert usage["completion_tokens"] == len(ref.token_ids)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # The repeat really was served from the prefix cache, and still gave the same answer.
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
