"""Log-probabilities of chosen tokens and the most likely ones, batched over the rows that ask.

Every function here works on whole ``(rows, vocab)`` tensors: the vocabulary is never walked in
Python, and one ``topk`` serves every row (each row then keeps its own k).
"""

from __future__ import annotations

import torch

from mmcache.shared.messages import TokenLogprobs

MAX_LOGPROBS = 20  # most top entries a request may ask for (OpenAI's top_logprobs limit)
# NOTE: JSON has no -inf: a token the distribution excludes (top-k, top-p, a grammar) reports this,
# as vLLM does.
FLOOR = -9999.0


def token_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, ks: list[int]) -> list[TokenLogprobs]:
    """Per row of ``logprobs`` (float32, (rows, vocab), normalised): the logprob and rank of the token
    ``chosen[row]`` and the ``ks[row]`` most likely tokens."""
    if not ks:
        return []
    chosen = chosen.to(logprobs.device, torch.long)
    own = logprobs.gather(1, chosen[:, None])
    ranks = (logprobs > own).sum(dim=-1) + 1
    k = max(ks)
    values, ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], chosen[:, None][:, :0])
    own_l = own[:, 0].clamp(min=FLOOR).tolist()
    values_l, ids_l, ranks_l = values.clamp(min=FLOOR).tolist(), ids.tolist(), ranks.tolist()
    return [
        TokenLogprobs(own_l[r], ids_l[r][: ks[r]], values_l[r][: ks[r]], ranks_l[r]) for r in range(len(ks))
    ]
