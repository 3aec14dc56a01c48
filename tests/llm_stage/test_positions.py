"""M-RoPE positions from media spans == HF ``get_rope_index`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).

A Qwen3-VL video is laid out as the processor lays it out: one span per temporal chunk, each
after its timestamp text and between vision start/end tokens.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
from transformers import AutoModelForImageTextToText

from mmcache.llm_stage.positions import mrope_positions
from mmcache.shared.checkpoint import ModelSpec
from mmcache.shared.messages import MediaSpan

ARCHS = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3-vl-moe")
MERGE = 2
TEMPORAL_PATCH = 2


@dataclass
class Ref:
    arch: str
    model: object
    spec: ModelSpec


_loaded: dict[str, Ref] = {}


def load_ref(arch: str, tiny_models) -> Ref:
    if arch not in _loaded:
        path = tiny_models[arch]
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        _loaded[arch] = Ref(arch, model, ModelSpec.load(path))
    return _loaded[arch]


@pytest.fixture(scope="module", params=ARCHS)
def ref(request, tiny_models) -> Ref:
    return load_ref(request.param, tiny_models)


@pytest.fixture(scope="module", params=[a for a in ARCHS if not a.startswith("qwen3")])
def ref_chunked(request, tiny_models) -> Ref:
    """Qwen2-VL and Qwen2.5-VL: a video is one span of temporal chunks."""
    return load_ref(request.param, tiny_models)


@pytest.fixture(scope="module", params=[a for a in ARCHS if a.startswith("qwen3")])
def ref_timestamped(request, tiny_models) -> Ref:
    """Qwen3-VL: each video chunk is its own span, after its timestamp."""
    return load_ref(request.param, tiny_models)


# A prompt layout: ("text", n) | ("image", (1, h, w)) | ("video", (t, h, w), fps); grids in patches.
Segment = tuple


def build(ref: Ref, layout: list[Segment]):
    """Token ids, HF's per-token modality ids, grids, and mmcache's spans for one layout."""
    ids: list[int] = []
    types: list[int] = []
    spans: list[MediaSpan] = []
    image_grids, video_grids, seconds = [], [], []
    text_token = 100
    for segment in layout:
        kind = segment[0]
        if kind == "text":
            ids += [text_token + i for i in range(segment[1])]
            types += [0] * segment[1]
            continue
        t, h, w = segment[1]
        n = t * h * w // (MERGE * MERGE)
        fps = segment[2] if kind == "video" else 1.0
        pad = ref.spec.image_token_id if kind == "image" else ref.spec.video_token_id
        spc = TEMPORAL_PATCH / fps if kind == "video" else 1.0
        keys = [bytes([len(spans), i]) * 8 for i in range(t)]
        if kind == "video" and ref.spec.family.timestamped_video:
            for key in keys:
                ids += [text_token] * 5  # "<t seconds>" (4 tokens, say) and vision start
                types += [0] * 5
                spans.append(MediaSpan(len(ids), kind, (1, h, w), [key], spc, MERGE))
                ids += [pad] * (n // t) + [text_token]  # then vision end
                types += [2] * (n // t) + [0]
            video_grids.append([t, h, w])
            seconds.append(spc)
            continue
        spans.append(MediaSpan(len(ids), kind, (1, h, w) if kind == "image" else (t, h, w), keys, spc, MERGE))
        ids += [pad] * n
        types += [1 if kind == "image" else 2] * n
        if kind == "image":
            image_grids.append([1, h, w])
        else:
            video_grids.append([t, h, w])
            seconds.append(spc)
    return ids, types, spans, image_grids, video_grids, seconds


def hf_positions(ref: Ref, ids, types, image_grids, video_grids, seconds):
    kwargs = {
        "input_ids": torch.tensor([ids]),
        "mm_token_type_ids": torch.tensor([types]),
        "image_grid_thw": torch.tensor(image_grids) if image_grids else None,
        "video_grid_thw": torch.tensor(video_grids) if video_grids else None,
        "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
    }
    if ref.arch == "qwen2.5-vl":
        kwargs["second_per_grid_ts"] = torch.tensor(seconds) if seconds else None
    positions, delta = ref.model.model.get_rope_index(**kwargs)
    return positions[:, 0], int(delta.reshape(-1)[0])


LAYOUTS = {
    "one_image": [("text", 5), ("image", (1, 8, 12)), ("text", 7)],
    "two_images": [("text", 3), ("image", (1, 4, 4)), ("text", 2), ("image", (1, 14, 22)), ("text", 9)],
    "tall_image": [("text", 1), ("image", (1, 72, 8)), ("text", 4)],
    "image_then_video": [
        ("text", 4),
        ("image", (1, 8, 8)),
        ("text", 3),
        ("video", (3, 16, 16), 2.0),
        ("text", 6),
    ],
    "video_then_image": [
        ("text", 2),
        ("video", (2, 12, 20), 2.0),
        ("text", 3),
        ("image", (1, 6, 8)),
        ("text", 5),
    ],
    "video_fps_1": [("text", 2), ("video", (2, 16, 16), 1.0), ("text", 3)],
    "video_fps_3": [("text", 2), ("video", (4, 16, 16), 3.0), ("text", 3)],
    "video_fps_4": [("text", 2), ("video", (5, 12, 12), 4.0), ("text", 3)],
    "image_first": [("image", (1, 4, 6)), ("text", 3)],
}


def test_text_only_positions_are_arange(ref: Ref):
    positions, delta = mrope_positions(11, [], ref.spec.tokens_per_second)
    assert positions.shape == (3, 11) and positions.dtype == torch.long
    assert torch.equal(positions, torch.arange(11).expand(3, -1))
    assert delta == 0
    # HF treats a text-only prompt the same way
    ids, types, *_ = build(ref, [("text", 11)])
    hf, hf_delta = hf_positions(ref, ids, types, [], [], [])
    assert torch.equal(positions, hf) and delta == hf_delta


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_positions_equal_hf_get_rope_index(ref: Ref, name: str):
    layout = LAYOUTS[name]
    for seg in layout:
        if seg[0] == "video":  # within the range where HF 5.24 matches the reference (see below)
            t, h, w = seg[1]
            interval = (
                ref.spec.tokens_per_second * TEMPORAL_PATCH / seg[2] if ref.spec.tokens_per_second else 1
            )
            assert int((t - 1) * interval) < max(h, w) // MERGE
    ids, types, spans, image_grids, video_grids, seconds = build(ref, layout)
    ours, delta = mrope_positions(len(ids), spans, ref.spec.tokens_per_second)
    hf, hf_delta = hf_positions(ref, ids, types, image_grids, video_grids, seconds)
    assert ours.shape == (3, len(ids))
    assert torch.equal(ours, hf), (ours - hf).abs().max()
    assert delta == hf_delta


def test_qwen25_spaces_video_chunks_by_time(ref_chunked: Ref):
    """Qwen2.5-VL: temporal position of chunk i is int(i * tokens_per_second * seconds_per_chunk)."""
    ref = ref_chunked
    assert not ref.spec.family.timestamped_video
    ids, _, spans, *_ = build(ref, [("text", 1), ("video", (3, 4, 4), 1.0), ("text", 1)])
    positions, _ = mrope_positions(len(ids), spans, ref.spec.tokens_per_second)
    t_axis = positions[0, 1:13].reshape(3, 4)[:, 0] - 1
    if ref.arch == "qwen2.5-vl":
        assert ref.spec.tokens_per_second == 2
        assert t_axis.tolist() == [0, 4, 8]  # 2 tokens/s * 2 s per chunk
    else:
        assert t_axis.tolist() == [0, 1, 2]


def test_span_order_in_the_list_does_not_matter(ref: Ref):
    ids, _, spans, *_ = build(ref, LAYOUTS["two_images"])
    a = mrope_positions(len(ids), spans, ref.spec.tokens_per_second)
    b = mrope_positions(len(ids), spans[::-1], ref.spec.tokens_per_second)
    assert torch.equal(a[0], b[0]) and a[1] == b[1]


def test_text_after_a_long_video_starts_past_its_largest_position(ref_chunked: Ref):
    """Reference behaviour (Qwen2-VL's original get_rope_index, vLLM): text after a media item
    starts at max(item positions) + 1. For a video with more temporal chunks than
    max(h, w) // merge the temporal axis holds that maximum; transformers 5.24 advances by
    max(h, w) // merge instead and so reuses positions the video already occupies. mmcache follows
    the reference; this test pins the difference so a change on either side is noticed."""
    ref = ref_chunked
    assert not ref.spec.family.timestamped_video
    layout = [("text", 3), ("video", (6, 4, 4), 2.0), ("text", 4)]  # 6 chunks > max(4, 4) // 2 = 2
    ids, types, spans, image_grids, video_grids, seconds = build(ref, layout)
    ours, delta = mrope_positions(len(ids), spans, ref.spec.tokens_per_second)
    video = slice(3, 3 + 6 * 4)
    video_max = int(ours[:, video].max())
    interval = ref.spec.tokens_per_second * TEMPORAL_PATCH / 2.0 if ref.spec.tokens_per_second else 1
    assert video_max == 3 + int(5 * interval)  # the temporal axis of the last chunk
    after = ours[:, video.stop :]
    assert torch.equal(after, (torch.arange(4) + video_max + 1).expand(3, -1))
    assert delta == video_max + 1 + 4 - len(ids)

    hf, _ = hf_positions(ref, ids, types, image_grids, video_grids, seconds)
    assert torch.equal(ours[:, : video.stop], hf[:, : video.stop])  # identical up to the video's end
    assert int(hf[0, video.stop]) == 3 + 4 // MERGE  # HF: start + max(h, w) // merge
    assert int(hf[0, video.stop]) <= video_max  # ... a position the video already used


def test_prompt_ending_in_media_and_generation_delta(ref: Ref):
    ids, types, spans, image_grids, video_grids, seconds = build(ref, [("text", 2), ("image", (1, 4, 8))])
    ours, delta = mrope_positions(len(ids), spans, ref.spec.tokens_per_second)
    hf, hf_delta = hf_positions(ref, ids, types, image_grids, video_grids, seconds)
    assert torch.equal(ours, hf) and delta == hf_delta
    # the first generated token (index len(ids)) sits one past the largest prompt position
    assert len(ids) + delta == int(ours.max()) + 1


def test_qwen3_video_chunks_are_laid_out_one_by_one(ref_timestamped: Ref):
    """Qwen3-VL: each chunk sits at its own start (t = h = w offset there, like an image) and the
    text after it starts max(h, w) // merge later, so a long video never reuses a position."""
    ref = ref_timestamped
    assert ref.spec.family.timestamped_video
    ids, types, spans, image_grids, video_grids, seconds = build(
        ref, [("text", 3), ("video", (6, 4, 8), 2.0), ("text", 4)]
    )
    assert len(spans) == 6
    ours, delta = mrope_positions(len(ids), spans, ref.spec.tokens_per_second)
    hf, hf_delta = hf_positions(ref, ids, types, image_grids, video_grids, seconds)
    assert torch.equal(ours, hf) and delta == hf_delta
    starts = [int(ours[0, s.offset]) for s in spans]
    steps = [b - a for a, b in itertools.pairwise(starts)]
    assert steps == [8 // MERGE + 6] * 5  # the chunk's grid, then 6 text tokens
