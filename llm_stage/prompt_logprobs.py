"""Prompt logprobs, and the per-token store that keeps them beside the KV blocks.

Token ``j``'s prompt logprob comes from the logits of row ``j - 1`` (the first token has none).
It depends on tokens ``[0, j]`` only, all covered by the hash of the block that holds token ``j``,
so it is kept in the slot of token ``j``: the store is laid out like the KV cache,
``(num_blocks, block_size, 1 + K_MAX)``, and indexed by the same block ids. A block reused by the
prefix cache brings its tokens' logprobs along; a block taken for reuse forgets them.

Column 0 holds the token's own entry (its rank in ``ids``, its logprob in ``values``; the token
itself is the block's token), columns ``1..K_MAX`` the most likely tokens, best first. Every
block stores all ``K_MAX`` (one topk), so a block that has them serves every request's k.

Prompt logprobs are those of the model's raw distribution (no temperature or logits processing,
which are about sampling the answer), as vLLM's are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmcache.llm_stage.logprobs import FLOOR, MAX_LOGPROBS
from mmcache.llm_stage.sequence import Sequence
from mmcache.shared.messages import TokenLogprobs

K_MAX = MAX_LOGPROBS
_PIECE_ROWS = 256  # prompt rows turned into logits at once: (rows, vocab) float32 stays small


class PromptLogprobStore:
    def __init__(self, num_blocks: int, block_size: int, device: torch.device):
        self.block_size = block_size
        self.ids = torch.zeros((num_blocks, block_size, 1 + K_MAX), dtype=torch.int32, device=device)
        self.values = torch.zeros((num_blocks, block_size, 1 + K_MAX), dtype=torch.float32, device=device)
        # NOTE: a block's slots are all written (by the sequence that computed it) or it counts as
        # carrying none: ``has[b]`` is set only for a whole block, cleared when the block is reused.
        self.has = [False] * num_blocks
        self.num_carrying = 0  # blocks whose ``has`` is set (read by the metrics thread)

    @staticmethod
    def bytes_per_block(block_size: int) -> int:
        return block_size * (1 + K_MAX) * (4 + 4)

    @property
    def nbytes(self) -> int:
        return self.ids.nbytes + self.values.nbytes

    def write(self, block_id: int, ids: torch.Tensor, values: torch.Tensor) -> None:
        """All slots of ``block_id``: ``ids`` / ``values`` shaped (block_size, 1 + K_MAX)."""
        self.ids[block_id] = ids.to(self.ids.device)
        self.values[block_id] = values.to(self.values.device)
        self.num_carrying += not self.has[block_id]
        self.has[block_id] = True

    def read(self, block_ids: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries of the first ``num_tokens`` tokens held by ``block_ids`` (in order), on the CPU."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.ids.device)
        ids = self.ids[index].flatten(0, 1)[:num_tokens]
        values = self.values[index].flatten(0, 1)[:num_tokens]
        return ids.cpu(), values.cpu()

    def forget(self, block_id: int) -> None:
        self.num_carrying -= self.has[block_id]
        self.has[block_id] = False


@dataclass(frozen=True, slots=True)
class Scored:
    """Prompt logprob entries of ``seq``'s tokens ``[start, start + len(ids))`` computed this step."""

    seq: Sequence
    start: int
    ids: torch.Tensor  # (tokens, 1 + K_MAX)
    values: torch.Tensor


def score(lm, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt logprob entries for rows ``hidden`` whose next tokens are ``targets``: (ids, values),
    each (rows, 1 + K_MAX), on the CPU. Batched in pieces of rows; the vocabulary is never walked."""
    out_ids, out_values = [], []
    for lo in range(0, hidden.shape[0], _PIECE_ROWS):
        logprobs = torch.log_softmax(lm.logits(hidden[lo : lo + _PIECE_ROWS]), dim=-1)
        target = targets[lo : lo + _PIECE_ROWS, None]
        own = logprobs.gather(1, target)
        rank = (logprobs > own).sum(dim=-1, keepdim=True) + 1
        top_values, top_ids = logprobs.topk(K_MAX, dim=-1)
        out_ids.append(torch.cat([rank, top_ids], dim=1).to(torch.int32).cpu())
        out_values.append(torch.cat([own, top_values], dim=1).clamp(min=FLOOR).cpu())
    return torch.cat(out_ids), torch.cat(out_values)


def entries(ids: torch.Tensor, values: torch.Tensor, k: int) -> list[TokenLogprobs | None]:
    """The wire form of every prompt token's entry (rows of ``ids`` / ``values``), top ``k`` kept;
    None for the first token."""
    ids_l, values_l = ids[:, : 1 + k].tolist(), values[:, : 1 + k].tolist()
    out: list[TokenLogprobs | None] = [None]
    out += [TokenLogprobs(v[0], i[1:], v[1:], i[0]) for i, v in zip(ids_l[1:], values_l[1:], strict=True)]
    return out
