"""Next-token choice: greedy, or temperature / top-k / top-p sampling with a per-request seed.

Rows whose request processes logits (penalties, bias, min_tokens, a grammar) are processed first,
in place; a step without any such row runs exactly as before. ``logits`` is then the final
distribution's input for every row.
"""

from __future__ import annotations

import hashlib

import torch

from llm_stage import logits_processors
from llm_stage.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """One token per row of ``logits`` (float32, (len(seqs), vocab))."""
    if any(s.matcher is not None or s.sampling.processes_logits for s in seqs):
        with torch.inference_mode():  # the model's logits are inference tensors, updated in place
            logits_processors.process(logits, seqs)
    out = logits.argmax(dim=-1).tolist()
    for i, seq in enumerate(seqs):
        sp = seq.sampling
        if not sp.greedy:
            out[i] = _sample_row(logits[i], sp.temperature, sp.top_k, sp.top_p, seq)
    for seq, token in zip(seqs, out, strict=True):
        if seq.matcher is not None:
            seq.matcher.consume_token(token)
    return out


def _sample_row(row: torch.Tensor, temperature: float, top_k: int, top_p: float, seq: Sequence) -> int:
    scaled = row / temperature
    if 0 < top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if seq.sampling.seed is not None:
        if seq.generator is None:
            seq.generator = torch.Generator(device=probs.device)
        # NOTE: seeded by (seed, output token index), not one stream from the seed: a generation
        # moved to another replica mid-answer (its tokens so far resent) draws what it would
        # have drawn here.
        seq.generator.manual_seed(step_seed(seq.sampling.seed, seq.num_output_tokens))
    return int(torch.multinomial(probs, 1, generator=seq.generator).item())


def step_seed(seed: int, index: int) -> int:
    """The generator seed for output token ``index`` of a request seeded with ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
