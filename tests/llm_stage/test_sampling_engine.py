"""Sampling controls through the real engine: greedy answers equal HF ``generate`` with the same
logits processors; grammars constrain what the tiny random model writes."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import jsonschema
import llguidance
import pytest
import torch

from mmcache.llm_stage.grammar import GrammarCache, GrammarError
from mmcache.processor.structured import JSON_OPTIONS
from mmcache.shared.messages import SamplingParams
from tests.llm_stage.test_engine import TEXT, env, hf_greedy, make_engine, make_prompt, make_seq, run

__all__ = ["env"]  # the fixture, shared with test_engine

MAX_NEW = 24


def hf_generate(env, prompt, **kwargs) -> list[int]:
    inputs = prompt.hf_inputs
    with torch.no_grad():
        out = env.hf_model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, **kwargs)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def generate(env, sampling: SamplingParams, matcher=None) -> list[int]:
    engine = make_engine(env)
    seq = make_seq(env, engine, 1, make_prompt(env, TEXT), sampling)
    seq.matcher = matcher
    ((tokens, _),) = run(engine, [seq]).values()
    return tokens


@pytest.mark.parametrize("penalty", [0.5, 3.0])
def test_greedy_with_repetition_penalty_equals_hf_generate(env, penalty: float) -> None:
    prompt = make_prompt(env, TEXT)
    want = hf_generate(env, prompt, repetition_penalty=penalty)
    assert (
        generate(env, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, repetition_penalty=penalty)) == want
    )
    if penalty < 1:  # favouring repeats changes this model's greedy answer (3.0 leaves it as it is)
        assert want != hf_greedy(env, prompt, MAX_NEW)


def test_min_tokens_equals_hf_min_new_tokens(env) -> None:
    prompt = make_prompt(env, TEXT)
    stop = hf_greedy(env, prompt, MAX_NEW)[2]  # greedy would stop at its third token
    sampling = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, stop_token_ids=[stop])
    assert generate(env, sampling)[-1] == stop and len(generate(env, sampling)) == 3
    got = generate(env, dataclasses.replace(sampling, min_tokens=MAX_NEW))
    assert got == hf_generate(
        env, prompt, min_new_tokens=MAX_NEW, eos_token_id=[stop, *env.spec.eos_token_ids]
    )
    assert len(got) == MAX_NEW


def test_logit_bias_bans_the_greedy_first_token(env) -> None:
    first = hf_greedy(env, make_prompt(env, TEXT), MAX_NEW)[0]
    got = generate(env, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, logit_bias={first: -100.0}))
    assert first not in got
    prompt = make_prompt(env, TEXT)
    assert got == hf_generate(env, prompt, sequence_bias={(first,): -100.0})


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 12},
        "rank": {"type": "integer", "minimum": 1, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["old", "new"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["city", "rank", "tags"],
    "additionalProperties": False,
}


def test_grammar_constrains_sampled_and_greedy_output(env) -> None:
    cache = GrammarCache(str(env.path), make_engine(env).lm.vocab_size, list(env.spec.eos_token_ids))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, JSON_OPTIONS)
    tokenizer = env.hf_processor.tokenizer

    async def matchers(n: int):
        return [await cache.matcher(grammar) for _ in range(n)]

    found = asyncio.run(matchers(4))
    assert (cache.stats.compiles, cache.stats.hits) == (1, 3)  # compiled once, then copies
    for i, matcher in enumerate(found):
        temperature = 0.0 if i == 0 else 1.0
        tokens = generate(env, SamplingParams(max_tokens=80, temperature=temperature, seed=i), matcher)
        assert matcher.is_stopped() and len(tokens) < 80  # the object closed inside the budget
        jsonschema.validate(json.loads(tokenizer.decode(tokens, skip_special_tokens=True)), SCHEMA)
    with pytest.raises(GrammarError):
        asyncio.run(cache.matcher(llguidance.LLMatcher.grammar_from_lark("start: missing_rule")))
    cache.close()
