"""Checks on a generate request before it can touch the engine.

The processor validates client input; this is the stage's own guard, so that
no peer can crash the engine or write garbage into shared KV blocks.
"""

from __future__ import annotations

import math

import torch

from mmcache.llm_stage.logprobs import MAX_LOGPROBS
from mmcache.llm_stage.text_model import TextLM
from mmcache.shared.checkpoint import ModelSpec
from mmcache.shared.messages import GenerateRequest, MediaSpan, ProbeRequest


class RequestError(ValueError):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def validate(msg: GenerateRequest, spec: ModelSpec, lm: TextLM, max_model_len: int) -> None:
    _check_prompt(msg.prompt_token_ids, lm.vocab_size)
    num_tokens = msg.prompt_token_ids.numel()
    if num_tokens >= max_model_len:
        raise RequestError(
            "context_length_exceeded",
            f"prompt has {num_tokens} tokens; the model's context is {max_model_len} tokens",
        )
    _check_sampling(msg, lm.vocab_size)
    resumed = msg.resume_token_ids
    if not isinstance(resumed, list) or not all(
        isinstance(t, int) and 0 <= t < lm.vocab_size for t in resumed
    ):
        raise RequestError("bad_resume", f"resume_token_ids must be token ids in [0, {lm.vocab_size})")
    if len(resumed) >= min(msg.sampling.max_tokens, max_model_len - num_tokens):
        raise RequestError("bad_resume", "resume_token_ids leave no token to generate")
    num_chunks = _check_spans(msg.prompt_token_ids, msg.spans, spec)
    if len(msg.sources) != num_chunks or len(msg.handoff) != num_chunks:
        raise RequestError("bad_spans", f"need one encoder source and hand-off flag per chunk ({num_chunks})")


def validate_probe(msg: ProbeRequest, spec: ModelSpec, lm: TextLM) -> None:
    _check_prompt(msg.prompt_token_ids, lm.vocab_size)
    _check_spans(msg.prompt_token_ids, msg.spans, spec)
    if any(not isinstance(h, bytes) or len(h) != 16 for h in msg.block_hashes):
        raise RequestError("bad_probe", "block hashes are 16-byte digests")


def _check_prompt(ids: torch.Tensor, vocab_size: int) -> None:
    if ids.dtype not in (torch.int32, torch.int64) or ids.ndim != 1 or ids.numel() == 0:
        raise RequestError("bad_prompt", "prompt_token_ids must be a non-empty 1-D integer tensor")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise RequestError("bad_prompt", f"token ids must lie in [0, {vocab_size})")


def _check_sampling(msg: GenerateRequest, vocab_size: int) -> None:
    sp = msg.sampling
    if sp.max_tokens < 1:
        raise RequestError("bad_sampling", "max_tokens must be >= 1")
    if not 0.0 <= sp.temperature <= 100.0:
        raise RequestError("bad_sampling", "temperature must be in [0, 100]")
    if not 0.0 < sp.top_p <= 1.0:
        raise RequestError("bad_sampling", "top_p must be in (0, 1]")
    if sp.top_k < 0:
        raise RequestError("bad_sampling", "top_k must be >= 0")
    numbers = (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty)
    if (
        not all(isinstance(x, (int, float)) and math.isfinite(x) for x in numbers)
        or sp.repetition_penalty <= 0
    ):
        raise RequestError("bad_sampling", "penalties must be finite numbers, repetition_penalty > 0")
    if not isinstance(sp.logit_bias, dict) or not all(
        isinstance(t, int) and 0 <= t < vocab_size and isinstance(b, (int, float)) and math.isfinite(b)
        for t, b in sp.logit_bias.items()
    ):
        raise RequestError(
            "bad_sampling", f"logit_bias maps token ids in [0, {vocab_size}) to finite numbers"
        )
    if not isinstance(sp.min_tokens, int) or sp.min_tokens < 0:
        raise RequestError("bad_sampling", "min_tokens must be >= 0")
    if sp.grammar is not None and not isinstance(sp.grammar, str):
        raise RequestError("bad_sampling", "grammar must be a string")
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(sp, name)
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_LOGPROBS):
            raise RequestError("bad_sampling", f"{name} must be null or an integer in [0, {MAX_LOGPROBS}]")


def _check_spans(ids: torch.Tensor, spans: list[MediaSpan], spec: ModelSpec) -> int:
    """Spans must cover their placeholder tokens without overlap; returns the number of chunks."""
    cursor = 0
    chunks = 0
    for span in spans:
        if span.modality not in ("image", "video") or span.offset < cursor:
            raise RequestError(
                "bad_spans", "media spans must be image/video, in prompt order and not overlapping"
            )
        t, h, w = span.grid_thw
        if (
            span.merge_size != spec.spatial_merge_size
            or t != len(span.chunk_keys)
            or h <= 0
            or w <= 0
            or h % span.merge_size
            or w % span.merge_size
        ):
            raise RequestError("bad_spans", f"span at {span.offset} has an inconsistent grid {span.grid_thw}")
        if any(len(k) != 16 for k in span.chunk_keys):
            raise RequestError("bad_spans", "chunk keys are 16-byte digests")
        pad = spec.image_token_id if span.modality == "image" else spec.video_token_id
        end = span.offset + span.num_tokens
        if span.num_tokens == 0 or end > ids.numel() or not bool((ids[span.offset : end] == pad).all()):
            raise RequestError("bad_spans", f"span at {span.offset} does not cover its placeholder tokens")
        cursor = end
        chunks += len(span.chunk_keys)
    return chunks
