"""M-RoPE positions of a prompt from its media spans (every family in ``shared.family``).

Text tokens advance all three axes together. An image or video places its
tokens on a (t, h, w) grid starting at the current position; the text after it
starts one past the largest position the grid used, as in the reference
implementation (Qwen2-VL's ``get_rope_index`` and vLLM). A Qwen3-VL video
arrives as one single-chunk span per temporal chunk (timestamp text between
them), so each chunk is laid out like an image, which is its reference rule;
how the three axes share the rotary frequencies (interleaved for Qwen3-VL) is
the text model's rotary class's business, not this module's.

NOTE: transformers 5.24 advances by ``max(h, w) // merge`` after a video and so
ignores the temporal extent; for videos with more temporal chunks than
``max(h, w) // merge`` its positions after the video differ from the reference.
"""

from __future__ import annotations

import torch

from mmcache.shared.messages import MediaSpan


def mrope_positions(
    num_tokens: int, spans: list[MediaSpan], tokens_per_second: float
) -> tuple[torch.Tensor, int]:
    """Positions (3, num_tokens) and the delta for generated tokens (position = index + delta)."""
    parts: list[torch.Tensor] = []
    current = 0  # next free position
    cursor = 0  # next token index
    for span in sorted(spans, key=lambda s: s.offset):
        if span.offset > cursor:
            parts.append(_text(cursor, span.offset, current))
            current += span.offset - cursor
        grid = _grid(span, current, tokens_per_second)
        parts.append(grid)
        current = int(grid.max()) + 1
        cursor = span.offset + span.num_tokens
    if num_tokens > cursor:
        parts.append(_text(cursor, num_tokens, current))
        current += num_tokens - cursor
    positions = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
    return positions, current - num_tokens


def _text(start: int, end: int, first_position: int) -> torch.Tensor:
    return (torch.arange(end - start, dtype=torch.long) + first_position).expand(3, -1)


def _grid(span: MediaSpan, start: int, tokens_per_second: float) -> torch.Tensor:
    t = len(span.chunk_keys)
    h = span.grid_thw[1] // span.merge_size
    w = span.grid_thw[2] // span.merge_size
    interval = tokens_per_second * span.seconds_per_chunk if span.modality == "video" else 1.0
    if tokens_per_second and span.modality == "video":
        # NOTE: same float arithmetic as the reference, then truncation toward zero.
        t_index = (torch.arange(t) * interval).long()
    else:
        t_index = torch.arange(t)
    tt, hh, ww = torch.meshgrid(t_index, torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start
