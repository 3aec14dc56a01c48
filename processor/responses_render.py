"""A Responses API answer (``POST /v1/responses``) rendered from its chat completion: the
Response object (output items: one assistant ``message``, and a ``function_call`` per tool
call), kept for ``previous_response_id`` unless ``store`` is false, or, streamed, the Responses
event sequence's events."""

from __future__ import annotations

import time
import uuid
from typing import Any

from mmcache.processor.response_store import ResponseStore
from mmcache.processor.responses import Completion
from mmcache.processor.responses_api import ResponsesRequest


class ResponseRender:
    """A Response's shapes for one completion: the object, its output items, its events."""

    def __init__(self, req: ResponsesRequest, completion: Completion, model: str, response_id: str = ""):
        self.req = req
        self.completion = completion
        self.model = model
        self.id = response_id or "resp_" + uuid.uuid4().hex
        self.created_at = int(time.time())
        self.message_id = "msg_" + uuid.uuid4().hex
        self._seq = 0
        self.streamed: str | None = None  # the text, when a stream has taken it as it came
        self._output: tuple[list[dict], dict] | None = None

    # --- the Response object ----------------------------------------------------------

    def response(self, status: str, output: list[dict], usage: bool) -> dict:
        body = self.req.body
        fmt = (body.get("text") or {}).get("format") or {"type": "text"}
        incomplete = status == "incomplete"
        out: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "model": self.model,
            "output": output,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": None,
            "store": self.req.store,
            "temperature": self.req.chat.temperature,
            "top_p": self.req.chat.top_p,
            "text": {"format": fmt},
            "tool_choice": body.get("tool_choice") or "auto",
            "tools": [_echo_tool(t) for t in body.get("tools") or []],
            "truncation": "disabled",
            "metadata": body.get("metadata") or {},
        }
        if body.get("user") is not None:
            out["user"] = body["user"]
        if usage:
            out["usage"] = self.usage()
        return out

    def usage(self) -> dict:
        u = self.completion.usage()
        cached = u["prompt_tokens_details"]["cached_tokens"]
        return {
            "input_tokens": u["prompt_tokens"],
            # NOTE: what was not read from the prefix cache was prefilled and written to it.
            "input_tokens_details": {
                "cached_tokens": cached,
                "cache_write_tokens": u["prompt_tokens"] - cached,
            },
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"],
            "mm_cache": u["mm_cache"],
        }

    @property
    def status(self) -> str:
        return "incomplete" if self.completion.choices[0].finish_reason == "length" else "completed"

    def output(self) -> tuple[list[dict], dict]:
        """The output items, and the answer's assistant turn in chat form (what the store keeps);
        call once the answer has ended.

        NOTE: made once: the choice's text is taken from its detokenizer as it is read.
        """
        if self._output is not None:
            return self._output
        message = self.completion.choices[0].message()
        if self.streamed is not None:
            message["content"] = self.streamed
        calls = message.get("tool_calls") or []
        items: list[dict] = []
        text = message["content"] or ""
        if text or not calls:
            items.append(self.message_item(text, self.status))
        for call in calls:
            items.append(_call_item(call))
        turn: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            turn["tool_calls"] = calls
        self._output = items, turn
        return self._output

    def message_item(self, text: str | None, status: str) -> dict:
        content = [] if text is None else [_text_part(text)]
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def final(self, store: ResponseStore) -> dict:
        """The finished Response; kept for ``previous_response_id`` unless ``store`` was false."""
        items, turn = self.output()
        if self.req.store:
            store.put(self.id, self.req.chat.cache_salt, [*self.req.history, turn])
        return self.response(self.status, items, usage=True)

    # --- the stream's events ----------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> dict:
        out = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return out


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(call: dict) -> dict:
    fn = call["function"]
    return {
        "type": "function_call",
        "id": "fc_" + call["id"].removeprefix("call_"),
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn["arguments"],
        "status": "completed",
    }


def _echo_tool(tool: dict) -> dict:
    return {
        "type": "function",
        "name": tool.get("name"),
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
        "strict": tool.get("strict", True),
    }
