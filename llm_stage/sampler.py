"""Next-token choice: greedy, or temperature / top-k / top-p sampling with a per-request seed.

Rows whose request processes logits (penalties, bias, min_tokens, a grammar) are processed first,
in place; a step without any such row runs exactly as before. ``logits`` is then the final
distribution's input for every row.

Output logprobs (only rows whose request asks) are those of the distribution the token is drawn
from: after the logits processors, temperature, top-k and top-p (vLLM's "processed" logprobs);
tokens that top-k / top-p exclude get :data:`llm_stage.logprobs.FLOOR`. A greedy row's distribution
is the processed logits' softmax at temperature 1 (its argmax is the token).
"""

from __future__ import annotations

import hashlib

import torch

from mmcache.llm_stage import logits_processors
from mmcache.llm_stage.logprobs import token_logprobs
from mmcache.llm_stage.sequence import Sequence
from mmcache.shared.messages import TokenLogprobs


def sample_with_logprobs(
    logits: torch.Tensor, seqs: list[Sequence]
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """One token per row, and its logprobs where the row's request asks (else None)."""
    if any(s.matcher is not None or s.sampling.processes_logits for s in seqs):
        with torch.inference_mode():  # the model's logits are inference tensors, updated in place
            logits_processors.process(logits, seqs)
    out = logits.argmax(dim=-1).tolist()
    asking = [i for i, s in enumerate(seqs) if s.sampling.logprobs is not None]
    drawn: dict[int, torch.Tensor] = {}  # row → logprobs of its (non-greedy) final distribution
    for i, seq in enumerate(seqs):
        sp = seq.sampling
        if not sp.greedy:
            out[i], probs = _sample_row(logits[i], sp.temperature, sp.top_k, sp.top_p, seq)
            if sp.logprobs is not None:
                drawn[i] = (probs / probs.sum()).log()
    for seq, token in zip(seqs, out, strict=True):
        if seq.matcher is not None:
            seq.matcher.consume_token(token)
    logprobs: list[TokenLogprobs | None] = [None] * len(seqs)
    if asking:
        with torch.inference_mode():
            dist = torch.log_softmax(logits[asking], dim=-1)
            for r, i in enumerate(asking):
                if i in drawn:
                    dist[r] = drawn[i]
            chosen = torch.tensor([out[i] for i in asking])
            ks = [seqs[i].sampling.logprobs or 0 for i in asking]
            for i, lp in zip(asking, token_logprobs(dist, chosen, ks), strict=True):
                logprobs[i] = lp
    return out, logprobs


def _sample_row(
    row: torch.Tensor, temperature: float, top_k: int, top_p: float, seq: Sequence
) -> tuple[int, torch.Tensor]:
    """The drawn token and the (unnormalised) probabilities it was drawn from."""
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
    return int(torch.multinomial(probs, 1, generator=seq.generator).item()), probs


def step_seed(seed: int, index: int) -> int:
    """The generator seed for output token ``index`` of a request seeded with ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
