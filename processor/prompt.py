"""Token ids and media spans of a chat: the checkpoint's chat template, then placeholder expansion."""

from __future__ import annotations

from transformers import AutoProcessor

from processor.errors import bad_request
from processor.preprocess import MediaLayout
from shared.checkpoint import ModelSpec
from shared.messages import MediaSpan


class PromptBuilder:
    def __init__(self, spec: ModelSpec):
        processor = AutoProcessor.from_pretrained(spec.path)
        self.tokenizer = processor.tokenizer
        self.chat_template = processor.chat_template or self.tokenizer.chat_template
        if not self.chat_template:
            raise ValueError(f"{spec.path} has no chat template")
        self.pad_ids = {"image": spec.image_token_id, "video": spec.video_token_id}
        self._pad_texts = [self.tokenizer.convert_ids_to_tokens(i) for i in self.pad_ids.values()]

    def render(self, messages: list[dict]) -> str:
        for msg in messages:
            parts = msg["content"] if isinstance(msg["content"], list) else [{"text": msg["content"]}]
            for part in parts:
                if any(pad in part.get("text", "") for pad in self._pad_texts):
                    raise bad_request(
                        "message text must not contain the model's media placeholder tokens",
                        "invalid_content",
                    )
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, tokenize=False, add_generation_prompt=True
        )

    def build(self, messages: list[dict], media: list[MediaLayout]) -> tuple[list[int], list[MediaSpan]]:
        """Prompt token ids with each media placeholder expanded to its tokens, and the spans."""
        ids = self.tokenizer.encode(self.render(messages), add_special_tokens=False)
        by_id = {v: k for k, v in self.pad_ids.items()}
        out: list[int] = []
        spans: list[MediaSpan] = []
        items = iter(media)
        for token in ids:
            modality = by_id.get(token)
            if modality is None:
                out.append(token)
                continue
            layout = next(items, None)
            if layout is None or layout.modality != modality:
                raise bad_request("the chat template's media placeholders do not match the request's media")
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
