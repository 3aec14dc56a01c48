"""Batched logprob extraction: each row keeps its own k, ranks count the more likely tokens."""

from __future__ import annotations

import pytest
import torch

from mmcache.llm_stage.logprobs import FLOOR, token_logprobs


def test_rows_keep_their_own_k_and_rank() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 1.0, float("-inf")]])
    lp = torch.log_softmax(logits, dim=-1)
    out = token_logprobs(lp, torch.tensor([2, 3]), [2, 4])
    assert out[0].top_ids == [1, 2] and out[0].rank == 2
    assert out[0].logprob == float(lp[0, 2]) and out[0].top_logprobs == lp[0, [1, 2]].tolist()
    assert out[1].top_ids == [0, 2, 1, 3] and out[1].rank == 4
    assert out[1].logprob == FLOOR and out[1].top_logprobs[-1] == FLOOR  # -inf is not JSON


def test_zero_k_gives_the_token_alone() -> None:
    lp = torch.log_softmax(torch.randn(3, 10), dim=-1)
    out = token_logprobs(lp, torch.tensor([0, 5, 9]), [0, 0, 0])
    assert [o.top_ids for o in out] == [[], [], []]
    assert [o.logprob for o in out] == pytest.approx(lp[[0, 1, 2], [0, 5, 9]].tolist(), abs=1e-7)
