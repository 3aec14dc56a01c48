"""Checks on a generate request before it can touch the engine.

The processor validates client input; this is the stage's own guard, so that
no peer can crash the engine or write garbage into shared KV blocks.
"""

from __future__ import annotations

import torch

from llm_stage.text_model import TextLM
from shared.checkpoint import ModelSpec
from shared.messages import GenerateRequest


class RequestError(ValueError):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def validate(msg: GenerateRequest, spec: ModelSpec, lm: TextLM, max_model_len: int) -> None:
    ids = msg.prompt_token_ids
    if ids.dtype not in (torch.int32, torch.int64) or ids.ndim != 1 or ids.numel() == 0:
        raise RequestError("bad_prompt", "prompt_token_ids must be a non-empty 1-D integer tensor")
    if int(ids.min()) < 0 or int(ids.max()) >= lm.vocab_size:
        raise RequestError("bad_prompt", f"token ids must lie in [0, {lm.vocab_size})")
    if ids.numel() >= max_model_len:
        raise RequestError(
            "context_length_exceeded",
            f"prompt has {ids.numel()} tokens; the model's context is {max_model_len} tokens",
        )
    _check_sampling(msg)
    _check_spans(msg, spec, lm.config.hidden_size)


def _check_sampling(msg: GenerateRequest) -> None:
    sp = msg.sampling
    if sp.max_tokens < 1:
        raise RequestError("bad_sampling", "max_tokens must be >= 1")
    if not 0.0 <= sp.temperature <= 100.0:
        raise RequestError("bad_sampling", "temperature must be in [0, 100]")
    if not 0.0 < sp.top_p <= 1.0:
        raise RequestError("bad_sampling", "top_p must be in (0, 1]")
    if sp.top_k < 0:
        raise RequestError("bad_sampling", "top_k must be >= 0")


def _check_spans(msg: GenerateRequest, spec: ModelSpec, hidden: int) -> None:
    ids = msg.prompt_token_ids
    cursor = 0
    embeddings = iter(msg.embeddings)
    for span in sorted(msg.spans, key=lambda s: s.offset):
        pad = spec.image_token_id if span.modality == "image" else spec.video_token_id
        if span.modality not in ("image", "video") or span.offset < cursor:
            raise RequestError("bad_spans", "media spans must be image/video and must not overlap")
        end = span.offset + span.num_tokens
        if span.num_tokens == 0 or end > ids.numel() or not bool((ids[span.offset : end] == pad).all()):
            raise RequestError("bad_spans", f"span at {span.offset} does not cover its placeholder tokens")
        for _ in span.chunk_keys:
            emb = next(embeddings, None)
            if (
                emb is None
                or tuple(emb.shape) != (span.tokens_per_chunk, hidden)
                or not emb.is_floating_point()
            ):
                raise RequestError(
                    "bad_embeddings", f"embeddings for span at {span.offset} have the wrong shape"
                )
        cursor = end
    if next(embeddings, None) is not None:
        raise RequestError("bad_embeddings", "more embeddings than media chunks")
