"""Prefix hit rate of a multi-turn workload spread over several LLM replicas, KV store on vs off.

Engines driven in this process (no HTTP), the tiny checkpoint, one real ``redis-server``:
``--conversations`` conversations of ``--turns`` turns each (a ~200-token system prompt, then per
turn a ~30-token user message and the replica's own greedy answer of 8 tokens). Turn ``t`` of
conversation ``c`` goes to replica ``(c + t) % R`` (round-robin: every turn lands on another
replica than the one before, as after a failover or with probes that do not find the holder).
Hit rate = prompt tokens served from a cache / prompt tokens, over every turn after the first
(the first turn of a conversation has nothing to hit). Answers with the store on must equal the
answers with it off (checked).

    python -m mmcache.benchmarks.kv_tier_hits [--quick]
"""

from __future__ import annotations

import asyncio

import numpy as np

from mmcache.benchmarks.common import Result, main, model_dir, say
from mmcache.kv_store_server import RedisServer
from mmcache.llm_stage.engine import Engine
from mmcache.llm_stage.sequence import Sequence
from mmcache.shared.block_hash import root_hash
from mmcache.shared.checkpoint import ModelSpec
from mmcache.shared.config import LLMConfig
from mmcache.shared.messages import SamplingParams

SAMPLING = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
MAX_STEPS = 5000


class Replica:
    def __init__(self, spec: ModelSpec, path: str, store: str):
        cfg = LLMConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=512, kv_store=store)
        self.engine = Engine(cfg, spec)
        self.spec = spec
        self.loop = asyncio.new_event_loop()
        self.ids = 0

    def run(self, prompt: list[int]) -> tuple[list[int], int]:
        """Greedy answer and the prompt tokens served from a cache (local pool or store)."""
        self.ids += 1
        seq = Sequence.new(
            self.ids,
            prompt,
            [],
            root_hash(self.spec.weights_fingerprint, None),
            SAMPLING,
            self.engine.max_model_len,
            self.spec.eos_token_ids,
            self.spec.tokens_per_second,
        )
        self.engine.submit(seq)
        out: list[int] = []
        for _ in range(MAX_STEPS):
            if not self.engine.has_work():
                break
            result = self.engine.step()
            tier = self.engine.kv_tier
            for wanted in result.kv_fetches:
                assert tier is not None
                blocks = self.loop.run_until_complete(tier.fetch(wanted.hashes))
                self.engine.add_kv(wanted.seq, wanted.first, blocks)
            out += [o.token_id for o in result.outputs if o.token_id is not None]
        if self.engine.kv_tier is not None:
            self.engine.kv_tier.flush()
        return out, seq.num_cached_tokens

    def close(self) -> None:
        if self.engine.kv_tier is not None:
            self.engine.kv_tier.close()
        self.loop.close()


def workload(
    replicas: list[Replica], conversations: int, turns: int, vocab: int
) -> tuple[float, list[list[int]]]:
    rng = np.random.default_rng(11)
    hits = queries = 0
    answers: list[list[int]] = []
    history = [rng.integers(100, vocab, 200).tolist() for _ in range(conversations)]
    for t in range(turns):
        for c in range(conversations):
            history[c] += rng.integers(100, vocab, 30).tolist()
            answer, cached = replicas[(c + t) % len(replicas)].run(history[c])
            answers.append(answer)
            if t:
                hits += cached
                queries += len(history[c])
            history[c] += answer
    return hits / queries, answers


def run(quick: bool = False) -> list[Result]:
    path = model_dir()
    spec = ModelSpec.load(path)
    conversations, turns = (4, 3) if quick else (8, 4)
    results = []
    store = RedisServer().start()
    try:
        for n in (2, 4):
            rates = {}
            answers = {}
            for on in (False, True):
                store.client().flushall()
                reps = [Replica(spec, str(path), store.url if on else "") for _ in range(n)]
                vocab = reps[0].engine.lm.vocab_size
                rates[on], answers[on] = workload(reps, conversations, turns, min(vocab, 2000))
                for r in reps:
                    r.close()
            assert answers[True] == answers[False], "the store changed an answer"
            say(f"# {n} replicas: hit rate store off {rates[False]:.3f}, on {rates[True]:.3f}")
            for on in (False, True):
                results.append(
                    Result(
                        f"kv_tier_hits.{n}_replicas.store_{'on' if on else 'off'}",
                        f"prefix hit rate, multi-turn, round-robin over {n} replicas, store "
                        + ("on" if on else "off"),
                        rates[on],
                        None,
                        unit="",
                    )
                )
    finally:
        store.stop()
    return results


if __name__ == "__main__":
    main(run, __doc__)
