"""The legacy Completions API (``POST /v1/completions``) on chat's internals.

A prompt (text, or token ids) is sent as it is: no chat template. ``echo`` puts the prompt
before the answer and, with ``logprobs``, scores it from the LLM stage's prompt logprobs (the
prompt-logprob store makes a prefix hit cheap); ``max_tokens: 0`` asks for the score alone (one
token is generated and left out). ``logprobs`` is the legacy top-k shape (tokens,
token_logprobs, top_logprobs, text_offset). Several prompts in one request are answered as one
list of choices, prompt by prompt (``n`` each), as OpenAI's are.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

from mmcache.processor import logprobs as lp_shapes
from mmcache.processor.errors import bad_request
from mmcache.processor.generation import Engine
from mmcache.processor.request import ChatRequest, parse_chat_request
from mmcache.processor.responses import Completion

MAX_PROMPTS = 16  # most prompts in one request
MAX_LEGACY_LOGPROBS = 5  # OpenAI's limit for the legacy ``logprobs``
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint
# Fields of the legacy API this server does not implement (a 400 names them).
UNSUPPORTED = ("suffix", "best_of")
_OWN = ("prompt", "echo", "logprobs", "suffix", "best_of", "max_tokens", "messages")


@dataclass(frozen=True, slots=True)
class CompletionsRequest:
    chat: ChatRequest  # sampling, n, stop, stream … as chat parses them (messages unused)
    prompts: list[list[int]]
    echo: bool
    logprobs: int | None  # the legacy top-k (None: none)
    score_only: bool  # max_tokens 0: the prompt's score, no answer


def parse_completions(body: Any, tokenizer) -> CompletionsRequest:
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    for name in UNSUPPORTED:
        value = body.get(name)
        if value is not None and not (name == "best_of" and value == 1):
            raise bad_request(
                f"'{name}' is not supported by this server's /v1/completions", "unsupported_parameter", name
            )
    max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
        raise bad_request(
            f"'max_tokens' must be an integer >= 0, got {max_tokens!r}", "invalid_max_tokens", "max_tokens"
        )
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise bad_request("'echo' must be a boolean", "invalid_echo", "echo")
    logprobs = body.get("logprobs")
    if logprobs is not None and (
        not isinstance(logprobs, int)
        or isinstance(logprobs, bool)
        or not 0 <= logprobs <= MAX_LEGACY_LOGPROBS
    ):
        raise bad_request(
            f"'logprobs' must be an integer in [0, {MAX_LEGACY_LOGPROBS}]", "invalid_logprobs", "logprobs"
        )
    chat_body = {k: v for k, v in body.items() if k not in _OWN}
    chat_body["messages"] = [{"role": "user", "content": ""}]  # NOTE: a placeholder; never rendered
    # NOTE: max_tokens 0 (score the prompt) still generates one token at the stage; it is left out.
    chat_body["max_tokens"] = max(max_tokens, 1)
    if logprobs is not None:
        chat_body["logprobs"] = True
        chat_body["top_logprobs"] = logprobs
    chat = parse_chat_request(chat_body)
    if chat.tools is not None or chat.grammar is not None:
        name = "tools" if chat.tools is not None else "response_format"
        raise bad_request(f"'{name}' is not supported by /v1/completions", "unsupported_parameter", name)
    if echo and logprobs is not None:
        chat.prompt_logprobs = logprobs
    prompts = _prompts(body.get("prompt"), tokenizer)
    if chat.stream and len(prompts) > 1:
        raise bad_request("a streamed request takes one prompt", "invalid_prompt", "prompt")
    if chat.stream and echo and logprobs is not None:
        raise bad_request("'echo' with 'logprobs' cannot be streamed", "invalid_echo", "echo")
    if chat.stream and max_tokens == 0:
        raise bad_request("'max_tokens': 0 cannot be streamed", "invalid_max_tokens", "max_tokens")
    return CompletionsRequest(chat, prompts, echo, logprobs, max_tokens == 0)


def _prompts(raw: Any, tokenizer) -> list[list[int]]:
    """One or more prompts, each as token ids (text is tokenised without special tokens added)."""
    if isinstance(raw, str) or (isinstance(raw, list) and raw and _is_ids(raw)):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise bad_request(
            "'prompt' must be a string, a list of token ids, or a non-empty list of those",
            "invalid_prompt",
            "prompt",
        )
    if len(raw) > MAX_PROMPTS:
        raise bad_request(f"'prompt' takes at most {MAX_PROMPTS} prompts", "invalid_prompt", "prompt")
    out = []
    vocab = len(tokenizer)
    for i, item in enumerate(raw):
        if isinstance(item, str):
            ids = tokenizer.encode(item, add_special_tokens=False)
        elif isinstance(item, list) and _is_ids(item):
            ids = item
            if any(not 0 <= t < vocab for t in ids):
                raise bad_request(
                    f"prompt[{i}] holds a token id outside [0, {vocab})", "invalid_prompt", "prompt"
                )
        else:
            raise bad_request(
                f"prompt[{i}] must be a string or a list of token ids", "invalid_prompt", "prompt"
            )
        if not ids:
            raise bad_request(f"prompt[{i}] is empty", "invalid_prompt", "prompt")
        out.append(ids)
    return out


def _is_ids(items: list) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in items)


class CompletionsAnswer:
    """One request's choices, prompt by prompt, and its legacy response shapes."""

    def __init__(self, engine: Engine, req: CompletionsRequest, completion_id: str = ""):
        self.engine = engine
        self.req = req
        self.id = completion_id or "cmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self.text = lp_shapes.TokenText(engine.tokenizer)
        self.completions: list[Completion | None] = [None] * len(req.prompts)

    async def run(self) -> dict:
        """Every prompt's choices to their end (concurrently); the response body."""
        await asyncio.gather(*(self._one(i) for i in range(len(self.req.prompts))))
        return self.body()

    async def start(self, index: int) -> Completion:
        prepared = await self.engine.prepare(self.req.chat, self.req.prompts[index])
        completion = Completion(self.engine.model, self.req.chat, prepared, self.engine.tokenizer, self.id)
        self.completions[index] = completion
        return completion

    async def _one(self, index: int) -> None:
        completion = await self.start(index)
        try:
            await self.engine.run(completion)
        finally:
            self.engine.done(completion.prepared)

    @property
    def started(self) -> list[Completion]:
        return [c for c in self.completions if c is not None]

    def usage(self) -> dict:
        prompt = sum(c.num_prompt_tokens for c in self.started)
        answer = 0 if self.req.score_only else sum(c.usage()["completion_tokens"] for c in self.started)
        cached = sum(c.usage()["prompt_tokens_details"]["cached_tokens"] for c in self.started)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": answer,
            "total_tokens": prompt + answer,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def body(self) -> dict:
        choices = []
        for p, completion in enumerate(self.started):
            for choice in completion.choices:
                choices.append(self.choice(p * self.req.chat.n + choice.index, completion, choice))
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.engine.model,
            "choices": choices,
            "usage": self.usage(),
        }

    def choice(self, index: int, completion: Completion, choice) -> dict:
        prompt_ids = completion.prepared.token_ids
        answer_ids = [] if self.req.score_only else choice.detok.token_ids[: choice.num_output_tokens]
        text = "" if self.req.score_only else choice.message()["content"] or ""
        if self.req.echo:
            text = self.engine.tokenizer.decode(prompt_ids) + text
        logprobs = None
        if self.req.logprobs is not None:
            logprobs = self.legacy_logprobs(completion, choice, prompt_ids, answer_ids)
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": "length" if self.req.score_only else choice.openai_finish_reason,
        }

    def legacy_logprobs(self, completion: Completion, choice, prompt_ids: list[int], answer_ids) -> dict:
        """OpenAI's legacy shape: per token its text, logprob, top-k {text: logprob}, text offset."""
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        if self.req.echo:
            scored = choice.prompt_logprobs or [None] * len(prompt_ids)
            for token, lp in zip(prompt_ids, scored, strict=True):
                tokens.append(self.text(token))
                if lp is None:  # the first token: nothing precedes it
                    values.append(None)
                    tops.append(None)
                    continue
                values.append(lp.logprob)
                top = {self.text(t): v for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)}
                top.setdefault(self.text(token), lp.logprob)  # NOTE: vLLM's: the token itself too
                tops.append(top)
        for token, entry in zip(answer_ids, choice.logprobs, strict=False):
            tokens.append(self.text(token))
            values.append(entry["logprob"])
            tops.append({e["token"]: e["logprob"] for e in entry["top_logprobs"]})
        offsets, at = [], 0
        for token_text in tokens:
            offsets.append(at)
            at += len(token_text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def chunk(self, index: int, text: str, finish: str | None, logprobs: dict | None) -> dict:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.engine.model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}],
        }
