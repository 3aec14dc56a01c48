"""Batched logits processing before sampling: penalties, logit bias, min_tokens, grammar masks.

Each function takes the rows of one step that ask for it and works on whole rows at once (scatter,
gather, masks); nothing loops over the vocabulary. The order is HF's and vLLM's: penalties, then
the bias, then the bans (min_tokens, grammar); temperature and top-k/top-p come after, in the sampler.
"""

from __future__ import annotations

import torch

from mmcache.llm_stage.grammar import allowed_tokens
from mmcache.llm_stage.sequence import Sequence


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


def _token_tensor(seq: Sequence) -> torch.Tensor:
    """``seq.token_ids`` as a tensor, kept on the sequence and extended by the new tokens only (a
    long prompt is turned into a tensor once, not every step)."""
    have = seq.token_tensor
    n = 0 if have is None else have.numel()
    if n < len(seq.token_ids):
        new = torch.tensor(seq.token_ids[n:], dtype=torch.long)
        have = seq.token_tensor = new if have is None else torch.cat([have, new])
    assert have is not None  # a sequence has a token at least
    return have


def _padded(parts: list[torch.Tensor], pad: int, device: torch.device) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(parts, batch_first=True, padding_value=pad).to(device)


def repetition_penalty(logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> None:
    """HF's: every token of the prompt and the output has its logit divided by the penalty (multiplied,
    when negative)."""
    device, vocab = logits.device, logits.shape[1]
    # Padding points at an extra column, cut off again after the update.
    ids = _padded([_token_tensor(seqs[r]) for r in rows], vocab, device)
    penalty = torch.tensor([seqs[r].sampling.repetition_penalty for r in rows], device=device).unsqueeze(1)
    index = torch.tensor(rows, device=device)
    wide = torch.cat([logits[index], logits.new_zeros(len(rows), 1)], dim=1)
    seen = wide.gather(1, ids)
    wide.scatter_(1, ids, torch.where(seen < 0, seen * penalty, seen / penalty))
    logits[index] = wide[:, :vocab]


def presence_frequency_penalty(logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> None:
    """OpenAI's: ``logit -= frequency * count + presence * (count > 0)`` over the generated tokens.

    Worked at the tokens' positions only: each occurrence of a token takes ``frequency`` and its
    share ``presence / count`` off (a full-vocabulary pass costs more than the whole rest here).
    """
    device, vocab = logits.device, logits.shape[1]
    ids = _padded([_token_tensor(seqs[r])[seqs[r].num_prompt_tokens :] for r in rows], vocab, device)
    counts = torch.zeros(len(rows), vocab + 1, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    sp = [seqs[r].sampling for r in rows]
    frequency = torch.tensor([s.frequency_penalty for s in sp], device=device).unsqueeze(1)
    presence = torch.tensor([s.presence_penalty for s in sp], device=device).unsqueeze(1)
    index = torch.tensor(rows, device=device)
    wide = torch.cat([logits[index], logits.new_zeros(len(rows), 1)], dim=1)
    wide.scatter_add_(1, ids, -(frequency + presence / counts.gather(1, ids)))
    logits[index] = wide[:, :vocab]


def logit_bias(logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> None:
    row_ids: list[int] = []
    token_ids: list[int] = []
    values: list[float] = []
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
        device = logits.device
        logits[torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device)] = float("-inf")


def grammar_mask(logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> None:
    allowed = allowed_tokens([seqs[r].matcher for r in rows], logits.shape[1]).to(logits.device)
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
