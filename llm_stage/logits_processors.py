"""Batched logits processing before sampling: penalties, logit bias, min_tokens, grammar masks.

Each function takes the rows of one step that ask for it and works on whole rows at once (scatter,
gather, masks); nothing loops over the vocabulary. The order is HF's and vLLM's: penalties, then
the bias, then the bans (min_tokens, grammar); temperature and top-k/top-p come after, in the sampler.
"""

from __future__ import annotations

import torch

from llm_stage.grammar import allowed_tokens
from llm_stage.sequence import Sequence


def process(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Apply every sequence's processing to its row of ``logits`` (float32, (len(seqs), vocab)), in place."""
    rows = [i for i, s in enumerate(seqs) if s.sampling.repetition_penalty != 1.0]
    if rows:
        repetition_penalty(logits, rows, seqs)
    rows = [
        i
        for i, s in enumerate(seqs)
        if (s.sampling.presence_penalty or s.sampling.frequency_penalty) and s.num_output_tokens
    ]
    if rows:
        presence_frequency_penalty(logits, rows, seqs)
    rows = [i for i, s in enumerate(seqs) if s.sampling.logit_bias]
    if rows:
        logit_bias(logits, rows, seqs)
    rows = [i for i, s in enumerate(seqs) if s.num_output_tokens < s.sampling.min_tokens]
    if rows:
        ban_stop_tokens(logits, rows, seqs)
    rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
    if rows:
        grammar_mask(logits, rows, seqs)


def _padded(lists: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists as one (rows, longest) tensor, padded with each row's first id, and the mask of
    real entries."""
    width = max(len(ids) for ids in lists)
    ids = torch.tensor([x + [x[0]] * (width - len(x)) for x in lists], dtype=torch.long)
    lengths = torch.tensor([len(x) for x in lists])
    real = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    return ids.to(device), real.to(device)


def repetition_penalty(logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> None:
    """HF's: every token of the prompt and the output has its logit divided by the penalty (multiplied,
    when negative)."""
    ids, _ = _padded([seqs[r].token_ids for r in rows], logits.device)  # padding repeats a real id
    penalty = torch.tensor([seqs[r].sampling.repetition_penalty for r in rows], device=logits.device)
    index = torch.tensor(rows, device=logits.device)
    sub = logits[index]
    seen = sub.gather(1, ids)
    seen = torch.where(seen < 0, seen * penalty.unsqueeze(1), seen / penalty.unsqueeze(1))
    logits[index] = sub.scatter(1, ids, seen)


def presence_frequency_penalty(logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> None:
    """OpenAI's: ``logit -= frequency * count + presence * (count > 0)`` over the generated tokens."""
    ids, real = _padded([seqs[r].token_ids[seqs[r].num_prompt_tokens :] for r in rows], logits.device)
    counts = torch.zeros(len(rows), logits.shape[1], device=logits.device)
    counts.scatter_add_(1, ids, real.to(counts.dtype))
    sp = [seqs[r].sampling for r in rows]
    frequency = torch.tensor([s.frequency_penalty for s in sp], device=logits.device).unsqueeze(1)
    presence = torch.tensor([s.presence_penalty for s in sp], device=logits.device).unsqueeze(1)
    index = torch.tensor(rows, device=logits.device)
    logits[index] -= frequency * counts + presence * (counts > 0)


def logit_bias(logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> None:
    row_ids, token_ids, values = [], [], []
    for r in rows:
        bias = seqs[r].sampling.logit_bias
        row_ids += [r] * len(bias)
        token_ids += bias.keys()
        values += bias.values()
    device = logits.device
    logits.index_put_(
        (torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device)),
        torch.tensor(values, device=device, dtype=logits.dtype),
        accumulate=True,
    )


def ban_stop_tokens(logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> None:
    """min_tokens: no end-of-sequence or stop token before the output has that many tokens."""
    row_ids, token_ids = [], []
    for r in rows:
        stops = [t for t in seqs[r].stop_ids if t < logits.shape[1]]
        row_ids += [r] * len(stops)
        token_ids += stops
    if token_ids:
        logits[torch.tensor(row_ids), torch.tensor(token_ids)] = float("-inf")


def grammar_mask(logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> None:
    allowed = allowed_tokens([seqs[r].matcher for r in rows], logits.shape[1]).to(logits.device)
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
