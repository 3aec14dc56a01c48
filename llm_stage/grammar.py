"""Constrained decoding with llguidance: grammars compiled once, off the engine's step path.

A request with a grammar waits in ``WAITING_FOR_GRAMMAR`` while its grammar compiles, then gets
its own matcher (a copy of the compiled prototype); each step the sampler asks the matchers of
the batch for their token masks (:func:`allowed_tokens`) and feeds them the sampled tokens.
"""

from __future__ import annotations

import asyncio
import os
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from mmcache.shared.single_flight import SingleFlight

_BITS = torch.arange(32, dtype=torch.int32)


class GrammarError(ValueError):
    """The grammar does not compile against this model's tokenizer."""


@dataclass(slots=True)
class GrammarStats:
    compiles: int = 0
    hits: int = 0


class GrammarCache:
    """Compiled grammars by their text (LRU, at most ``capacity``); concurrent requests for one
    grammar wait for a single compile (:class:`SingleFlight`: a waiter that is cancelled, an
    aborted request, cancels neither the compile nor the other waiters, and the compiled grammar
    is kept even if every waiter has gone)."""

    def __init__(
        self, model_path: str | os.PathLike, vocab_size: int, eos_token_ids: list[int], capacity: int = 64
    ):
        self.model_path = model_path
        self.vocab_size = vocab_size  # the logits' width, which may exceed the tokenizer's
        self.eos_token_ids = eos_token_ids
        self.capacity = capacity
        self.stats = GrammarStats()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._flight: SingleFlight[str, llguidance.LLMatcher] = SingleFlight()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar")

    async def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher for ``grammar`` (raises :class:`GrammarError`)."""
        proto = self._compiled.get(grammar)
        if proto is not None:
            self._compiled.move_to_end(grammar)
            self.stats.hits += 1
            return proto.deep_copy()

        async def make() -> llguidance.LLMatcher:
            loop = asyncio.get_running_loop()
            made = await loop.run_in_executor(self._executor, self._compile, grammar)
            self._compiled[grammar] = made  # NOTE: here, not in a waiter: kept if all have gone
            if len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
            return made

        proto, compiled_here = await self._flight.run(grammar, make)
        if not compiled_here:
            self.stats.hits += 1
        return proto.deep_copy()

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        if self._tokenizer is None:
            # Only requests with a grammar need the tokenizer: loaded on the first one.
            from transformers import AutoTokenizer

            hf: Any = AutoTokenizer.from_pretrained(self.model_path)  # a fast (tokenizers) one
            self._tokenizer = llguidance.hf.from_tokenizer(
                hf, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
            )
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        # NOTE: the first mask builds the lexer states every copy starts from.
        matcher.compute_bitmask()
        self.stats.compiles += 1
        return matcher

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def allowed_tokens(matchers: list[llguidance.LLMatcher], vocab_size: int) -> torch.Tensor:
    """(len(matchers), vocab_size) bool: the tokens each matcher accepts next."""
    bitmask = llguidance.torch.allocate_token_bitmask(len(matchers), vocab_size)
    for i, matcher in enumerate(matchers):
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, i)
    bits = (bitmask.unsqueeze(-1) >> _BITS) & 1
    return bits.view(len(matchers), -1)[:, :vocab_size].bool()
