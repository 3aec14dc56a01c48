"""Batched logits processing equals HF's logits processors (and OpenAI's formula) row by row."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from mmcache.llm_stage import logits_processors
from mmcache.llm_stage.sampler import sample_with_logprobs
from mmcache.llm_stage.sequence import Sequence
from mmcache.shared.block_hash import root_hash
from mmcache.shared.messages import SamplingParams

VOCAB = 64
EOS = 7


def seq(prompt: list[int], output: list[int], **sampling) -> Sequence:
    return Sequence(
        seq_id=0,
        token_ids=prompt + output,
        num_prompt_tokens=len(prompt),
        positions=torch.zeros(3, len(prompt), dtype=torch.long),
        rope_delta=0,
        media=[],
        spans=[],
        root_hash=root_hash(b"x", None),
        sampling=SamplingParams(max_tokens=100, temperature=0.0, **sampling),
        max_model_len=1000,
        stop_ids=frozenset({EOS}),
    )


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_repetition_penalty_equals_hf_per_row() -> None:
    seqs = [
        seq([1, 2, 3, 3], [5, 9], repetition_penalty=1.3),
        seq([4], [], repetition_penalty=0.7),
        seq([1, 2], [8, 8, 8]),  # no penalty: untouched
        seq([10, 11, 12], [13], repetition_penalty=2.0),
    ]
    x = logits(len(seqs))
    got = x.clone()
    logits_processors.process(got, seqs)
    for i, s in enumerate(seqs):
        ids = torch.tensor([s.token_ids])
        want = RepetitionPenaltyLogitsProcessor(s.sampling.repetition_penalty)(ids, x[i : i + 1].clone())
        assert torch.equal(got[i], want[0]), i
    assert not torch.equal(got[0], x[0])  # it did something


def test_presence_and_frequency_penalties_follow_openai_over_output_tokens() -> None:
    s = seq([3, 3, 4], [5, 5, 6], presence_penalty=0.5, frequency_penalty=0.25)
    x = logits(1)
    got = x.clone()
    logits_processors.process(got, [s])
    want = x.clone()
    for token, count in ((5, 2), (6, 1)):
        want[0, token] -= 0.25 * count + 0.5
    assert torch.allclose(got, want)  # prompt tokens 3 and 4 are not penalised


def test_logit_bias_equals_hf_sequence_bias() -> None:
    bias = {3: -100.0, 9: 5.5, 60: 1.0}
    s = seq([1], [2], logit_bias=bias)
    x = logits(1)
    got = x.clone()
    logits_processors.process(got, [s])
    hf = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})
    assert torch.allclose(got, hf(torch.tensor([s.token_ids]), x.clone()))


def test_min_tokens_equals_hf_min_new_tokens() -> None:
    s = seq([1, 2, 3], [4], min_tokens=3)
    x = logits(1)
    x[0, EOS] = 50.0  # greedy would stop at once
    got = x.clone()
    logits_processors.process(got, [s])
    hf = MinNewTokensLengthLogitsProcessor(3, 3, EOS)
    assert torch.equal(got, hf(torch.tensor([s.token_ids]), x.clone()))
    assert sample_with_logprobs(got, [s])[0] != [EOS]
    done = seq([1, 2, 3], [4, 5, 6], min_tokens=3)  # has its three tokens: free to stop
    assert sample_with_logprobs(x.clone(), [done])[0] == [EOS]


def test_plain_rows_are_not_touched_in_a_mixed_batch() -> None:
    seqs = [seq([1, 2], [3]), seq([1, 2], [3], logit_bias={5: -100.0}), seq([9], [])]
    x = logits(3)
    got = x.clone()
    logits_processors.process(got, seqs)
    assert torch.equal(got[0], x[0]) and torch.equal(got[2], x[2])
    assert not torch.equal(got[1], x[1])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_minus_100_bans_the_favourite(temperature: float) -> None:
    x = logits(1)
    favourite = int(x.argmax())
    x[0, favourite] += 20.0  # overwhelmingly likely
    s = seq([1], [], logit_bias={favourite: -100.0})
    s.sampling = dataclasses.replace(s.sampling, temperature=temperature, seed=1)
    for _ in range(20):
        assert sample_with_logprobs(x.clone(), [s])[0] != [favourite]
