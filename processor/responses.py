"""OpenAI chat-completion response shapes and their SSE framing."""

from __future__ import annotations

import time
import uuid

import orjson
from aiohttp import web

from mmcache.processor import logprobs as lp_shapes
from mmcache.processor.detokenizer import Detokenizer
from mmcache.processor.pipeline import Prepared
from mmcache.processor.request import ChatRequest
from mmcache.processor.request_log import RequestRecord
from mmcache.processor.tool_stream import ToolCall, ToolStream, split_tool_calls
from mmcache.shared.messages import GenerateReply

SSE_DONE = b"data: [DONE]\n\n"


async def sse(resp: web.StreamResponse, payload: dict) -> None:
    await resp.write(b"data: " + orjson.dumps(payload) + b"\n\n")


def model_card(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "mmcache"}


class Choice:
    """One choice's tokens, text and finish; tool-call blocks come out as ``tool_calls``."""

    def __init__(self, index: int, tokenizer, req: ChatRequest, text: lp_shapes.TokenText | None = None):
        self.index = index
        self.detok = Detokenizer(tokenizer, req.stop, req.min_tokens)
        self.text = text or lp_shapes.TokenText(tokenizer)
        self.want_logprobs = req.logprobs
        self.logprobs: list[dict] = []  # OpenAI's logprobs.content entries, one per output token
        self._logprobs_sent = 0
        self.prompt_logprobs: list | None = None  # vLLM's shape, from the first reply that has them
        self.tools = ToolStream() if req.tools is not None else None
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None

    def update(self, chunk: GenerateReply) -> None:
        if self.finish_reason is not None:
            return  # a stop string ended it; the stage's last tokens are not part of the answer
        self.num_cached_tokens = chunk.num_cached_tokens
        if chunk.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = chunk.prompt_logprobs
        # NOTE: a stop string ends the answer at the token that completes it (vLLM's rule): the
        # tokens after it in this reply count nowhere (usage, token_ids, logprobs).
        kept = self.detok.add(chunk.token_ids)
        self.num_output_tokens += kept
        if self.want_logprobs and chunk.logprobs:
            self.logprobs += lp_shapes.content(self.text, chunk.token_ids[:kept], chunk.logprobs[:kept])
        if self.detok.stopped:
            self.finish_reason = "stop"
        elif chunk.finish_reason is not None:
            self.finish_reason = "length" if chunk.finish_reason == "length" else "stop"

    def deltas(self) -> list[dict]:
        """What to stream now, one delta per chunk: new text, and tool calls as their blocks are
        written (a call's first delta, with its name, is a chunk of its own, as OpenAI's is); an
        empty delta when only logprobs are new; none when nothing is."""
        final = self.finish_reason is not None
        text = self.detok.flush() if final else self.detok.safe_delta()
        content, calls = self.tools.feed(text, final) if self.tools is not None else (text, [])
        out: list[dict] = [{"content": content} if content else {}]
        for call in calls:
            entries = out[-1].setdefault("tool_calls", [])
            if any(e["index"] == call.index for e in entries):  # NOTE: a call once per chunk
                out.append({"tool_calls": (entries := [])})
            entries.append(call.as_dict())
        if out == [{}] and not self.pending_logprobs:
            return []
        return out

    def message(self) -> dict:
        text = self.detok.flush()
        calls: list[ToolCall] = []
        if self.tools is not None:
            text, calls = split_tool_calls(text)
            self.tools.calls = calls
        message: dict = {"role": "assistant", "content": text if text or not calls else None, "refusal": None}
        if calls:
            message["tool_calls"] = [call.as_dict() for call in calls]
        return message

    @property
    def pending_logprobs(self) -> bool:
        """Output logprobs not streamed yet."""
        return len(self.logprobs) > self._logprobs_sent

    def take_logprobs(self) -> dict | None:
        """A stream chunk's ``logprobs``: the entries since the last chunk (None when not asked)."""
        if not self.want_logprobs:
            return None
        new = self.logprobs[self._logprobs_sent :]
        self._logprobs_sent = len(self.logprobs)
        return {"content": new, "refusal": None}

    @property
    def openai_finish_reason(self) -> str:
        if self.tools is not None and self.tools.calls and self.finish_reason == "stop":
            return "tool_calls"
        return self.finish_reason or "stop"


class Completion:
    """Accumulates one completion's state and renders OpenAI response shapes."""

    def __init__(self, model: str, req: ChatRequest, prepared: Prepared, tokenizer, completion_id: str = ""):
        self.id = completion_id or "chatcmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.req = req
        self.prepared = prepared
        self.num_prompt_tokens = len(prepared.token_ids)
        self.text = lp_shapes.TokenText(tokenizer)
        self.choices = [Choice(i, tokenizer, req, self.text) for i in range(req.n)]
        self._prompt_logprobs_sent = False

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def fill(self, record: RequestRecord) -> None:
        """Copy this completion's numbers into its request-log record."""
        usage = self.usage()
        record.prompt_tokens = usage["prompt_tokens"]
        record.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
        record.completion_tokens = usage["completion_tokens"]
        record.mm_cache = usage["mm_cache"]

    def usage(self) -> dict:
        completion_tokens = sum(c.num_output_tokens for c in self.choices)
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.num_prompt_tokens + completion_tokens,
            # NOTE: the first choice's prefill; the others reuse it (n choices, one prompt).
            "prompt_tokens_details": {"cached_tokens": self.choices[0].num_cached_tokens},
            "mm_cache": self.prepared.report.as_dict(),
        }

    def body(self) -> dict:
        choices = []
        for c in self.choices:
            choice = {
                "index": c.index,
                "message": c.message(),
                "finish_reason": c.openai_finish_reason,
                "logprobs": {"content": c.logprobs, "refusal": None} if c.want_logprobs else None,
            }
            if self.req.return_token_ids:
                choice["token_ids"] = c.detok.token_ids
            choices.append(choice)
        out = {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        }
        if self.req.return_token_ids:
            out["prompt_token_ids"] = self.prepared.token_ids
        if self.req.prompt_logprobs is not None:
            out["prompt_logprobs"] = self._prompt_logprobs()
        return out

    def _prompt_logprobs(self) -> list | None:
        got = self.choices[0].prompt_logprobs
        return None if got is None else lp_shapes.prompt_logprobs(self.text, self.prepared.token_ids, got)

    def chunk(self, choice: Choice, delta: dict, finish: bool = False) -> dict:
        out = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": choice.index,
                    "delta": delta,
                    "finish_reason": choice.openai_finish_reason if finish else None,
                    "logprobs": choice.take_logprobs(),
                }
            ],
        }
        if self.req.include_usage:
            out["usage"] = None  # NOTE: OpenAI's: null on every chunk but the last (usage_chunk)
        if self.req.prompt_logprobs is not None and not self._prompt_logprobs_sent:
            prompt = self._prompt_logprobs()
            if prompt is not None:  # NOTE: vLLM's stream carries them once, in the first chunk that can
                out["prompt_logprobs"] = prompt
                self._prompt_logprobs_sent = True
        return out

    def usage_chunk(self) -> dict:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": self.usage(),
        }
