"""Token ids and media spans of a chat: the checkpoint's chat template, then placeholder expansion.

The family decides the placeholder layout (:mod:`shared.family`): an image, and a video of
Qwen2-VL / Qwen2.5-VL, is one run of pad tokens and one span; a Qwen3-VL video is one run
per temporal chunk, each after its timestamp text and between vision start/end tokens
(the reference processor's expansion), and each its own single-chunk span.
"""

from __future__ import annotations

import re
from functools import lru_cache

from transformers import AutoProcessor

from mmcache.processor.errors import bad_request
from mmcache.processor.preprocess import MediaLayout
from mmcache.shared.checkpoint import ModelSpec
from mmcache.shared.family import timestamp_text
from mmcache.shared.messages import MediaSpan


class PromptBuilder:
    def __init__(self, spec: ModelSpec):
        processor = AutoProcessor.from_pretrained(spec.path)
        self.tokenizer = processor.tokenizer
        self.chat_template = processor.chat_template or self.tokenizer.chat_template
        if not self.chat_template:
            raise ValueError(f"{spec.path} has no chat template")
        self.pad_ids = {"image": spec.image_token_id, "video": spec.video_token_id}
        self.timestamped_video = spec.family.timestamped_video
        self._vision_start: int | None = spec.config.get("vision_start_token_id")
        self._vision_end: int | None = spec.config.get("vision_end_token_id")
        if self.timestamped_video and (self._vision_start is None or self._vision_end is None):
            raise ValueError(f"{spec.path}: its config names no vision start/end token ids")
        self._pad_texts = [self.tokenizer.convert_ids_to_tokens(i) for i in self.pad_ids.values()]
        added = sorted(
            (t.content for t in self.tokenizer.added_tokens_decoder.values() if t.special),
            key=len,
            reverse=True,
        )
        self._special_ids = {t: self.tokenizer.convert_tokens_to_ids(t) for t in added}
        self._split = re.compile("(" + "|".join(map(re.escape, added)) + ")") if added else None
        self._encode_piece = lru_cache(maxsize=4096)(self._encode_text)

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        for msg in messages:
            parts = msg["content"] if isinstance(msg["content"], list) else [{"text": msg["content"]}]
            for part in parts:
                if any(pad in part.get("text", "") for pad in self._pad_texts):
                    raise bad_request(
                        "message text must not contain the model's media placeholder tokens",
                        "invalid_content",
                    )
        if tools and "tools" not in self.chat_template:
            raise bad_request(
                "this model's chat template has no tool format", "unsupported_parameter", "tools"
            )
        return self.tokenizer.apply_chat_template(
            messages,
            tools=[{"type": "function", "function": fn} for fn in tools] if tools else None,
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=True,
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered chat text, reusing the tokenization of pieces seen before.

        NOTE: special tokens are split out before BPE runs, so the text between two of them is
        tokenized on its own: encoding piece by piece equals encoding the whole (a test checks).
        A repeated system prompt or earlier turn is then a cache hit, not a re-tokenization.
        """
        if self._split is None:
            return self._encode_text(text)
        ids: list[int] = []
        for i, piece in enumerate(self._split.split(text)):
            if i % 2:
                ids.append(self._special_ids[piece])
            elif piece:
                ids += self._encode_piece(piece) if len(piece) <= 1 << 16 else self._encode_text(piece)
        return ids

    def _encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def build(
        self, messages: list[dict], media: list[MediaLayout], tools: list[dict] | None = None
    ) -> tuple[list[int], list[MediaSpan]]:
        """Prompt token ids with each media placeholder expanded to its tokens, and the spans."""
        ids = self.encode(self.render(messages, tools))
        by_id = {v: k for k, v in self.pad_ids.items()}
        out: list[int] = []
        spans: list[MediaSpan] = []
        items = iter(media)
        skip_end = False
        for i, token in enumerate(ids):
            if skip_end:
                skip_end = False
                continue
            modality = by_id.get(token)
            if modality is None:
                out.append(token)
                continue
            layout = next(items, None)
            if layout is None or layout.modality != modality:
                raise bad_request("the chat template's media placeholders do not match the request's media")
            if modality == "video" and self.timestamped_video:
                # NOTE: as the reference processor does, a placeholder wrapped in vision start/end
                # is replaced whole: each chunk brings its own start and end.
                wrapped = out[-1:] == [self._vision_start] and ids[i + 1 : i + 2] == [self._vision_end]
                if wrapped:
                    out.pop()
                    skip_end = True
                self._timestamped(layout, token, out, spans)
                continue
            spans.append(
                MediaSpan(
                    offset=len(out),
                    modality=modality,
                    grid_thw=layout.grid_thw,
                    chunk_keys=[c.key for c in layout.chunks],
                    seconds_per_chunk=layout.seconds_per_chunk,
                    merge_size=layout.merge_size,
                )
            )
            out += [token] * layout.num_tokens
        if next(items, None) is not None:
            raise bad_request("the chat template's media placeholders do not match the request's media")
        return out, spans

    def _timestamped(self, layout: MediaLayout, pad: int, out: list[int], spans: list[MediaSpan]) -> None:
        """Expand a video placeholder chunk by chunk: ``<t seconds>``, vision start, pads, vision end.

        NOTE: the timestamp text sits between two special tokens, so it is tokenized on its own,
        as in the reference's whole-prompt tokenization; a chunk's text depends only on its own
        frame times, so a growing video keeps the tokens of its leading chunks.
        """
        _, h, w = layout.grid_thw
        per_chunk = h * w // (layout.merge_size * layout.merge_size)
        start, end = self._vision_start, self._vision_end
        assert start is not None and end is not None  # checked at start-up
        for chunk, seconds in zip(layout.chunks, layout.timestamps, strict=True):
            out += self._encode_piece(timestamp_text(seconds))
            out.append(start)
            spans.append(
                MediaSpan(
                    offset=len(out),
                    modality="video",
                    grid_thw=(1, h, w),
                    chunk_keys=[chunk.key],
                    seconds_per_chunk=layout.seconds_per_chunk,
                    merge_size=layout.merge_size,
                )
            )
            out += [pad] * per_chunk
            out.append(end)
