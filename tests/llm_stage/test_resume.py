"""A generation moved to another replica mid-answer (``GenerateRequest.resume_token_ids``): a fresh
engine given the prompt plus the tokens generated so far, as output, continues with exactly the
tokens the uninterrupted run went on with: greedy, seeded sampling (its draws are keyed on the
output token index) and penalties (which count the resumed tokens as output)."""

from __future__ import annotations

import pytest

from mmcache.llm_stage.sampler import step_seed
from mmcache.shared.messages import SamplingParams
from tests.llm_stage.test_engine import (  # noqa: F401  (env is a fixture)
    Env,
    env,
    make_engine,
    make_prompt,
    make_seq,
    run,
)

MAX_NEW = 16
CASES = {
    "greedy": SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(MAX_NEW, 1.0, 0.9, 50, seed=11, ignore_eos=True),
    "penalties": SamplingParams(
        MAX_NEW, 0.0, ignore_eos=True, presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.3
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_generation_continues_exactly(env: Env, case: str):  # noqa: F811
    sampling = CASES[case]
    prompt = make_prompt(env, "Describe the picture.", images=[(300, 200, 1)])
    engine = make_engine(env)
    whole, reason = run(engine, [make_seq(env, engine, 1, prompt, sampling)])[1]
    assert len(whole) == MAX_NEW and reason == "length"
    for cut in (1, 7, MAX_NEW - 1):
        engine = make_engine(env)  # another replica: nothing cached
        seq = make_seq(env, engine, 2, prompt, sampling)
        seq.token_ids.extend(whole[:cut])  # what LLMService._sequence does with resume_token_ids
        rest, reason = run(engine, [seq])[2]
        assert whole[:cut] + rest == whole, cut  # nothing lost, nothing repeated
        assert reason == "length"


def test_step_seeds_differ_by_seed_and_index():
    seeds = {step_seed(s, i) for s in range(4) for i in range(64)}
    assert len(seeds) == 4 * 64 and all(0 <= x < 1 << 63 for x in seeds)
