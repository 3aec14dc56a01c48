"""The media rows of one step: where visual tokens sit in the batch and their feature sets.

Feature set 0 replaces the placeholder tokens' embeddings. Families with deepstack
(Qwen3-VL) have more sets: set ``1 + i`` is added to the hidden states of the same
tokens after decoder layer ``i``, as the reference adds them to the first layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmcache.llm_stage.sequence import MediaRows


@dataclass(slots=True)
class VisualRows:
    index: torch.Tensor  # (n,) batch rows of the visual tokens computed this step
    features: torch.Tensor  # (n, feature sets, hidden), in the hidden states' dtype and device

    @classmethod
    def gather(
        cls, items: list[tuple[int, int, int, list[MediaRows]]], like: torch.Tensor
    ) -> VisualRows | None:
        """``items``: (first batch row, first token, end token, media rows) of each sequence in the step;
        ``like``: the step's hidden states. None when the step holds no visual token."""
        rows: list[int] = []
        parts: list[torch.Tensor] = []
        for row, start, end, media in items:
            for m in media:
                lo, hi = max(start, m.start), min(end, m.end)
                if lo < hi:
                    rows += range(row + lo - start, row + hi - start)
                    parts.append(m.rows[lo - m.start : hi - m.start])
        if not parts:
            return None
        features = parts[0] if len(parts) == 1 else torch.cat(parts)
        index = torch.tensor(rows, dtype=torch.long, device=like.device)
        return cls(index, features.to(device=like.device, dtype=like.dtype))

    def place(self, hidden: torch.Tensor) -> None:
        """The tokens' embeddings become their merged visual embeddings."""
        hidden.index_copy_(0, self.index, self.features[:, 0])

    def add_deepstack(self, hidden: torch.Tensor, layer: int) -> None:
        """After decoder layer ``layer``: add its deepstack set, if the family has one for it.

        NOTE: each index occurs once, so the in-place add rounds exactly like the reference's
        ``hidden[mask] + embeds``.
        """
        if layer + 1 < self.features.shape[1]:
            hidden.index_add_(0, self.index, self.features[:, layer + 1])
