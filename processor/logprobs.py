"""OpenAI's ``choices[].logprobs`` and vLLM's ``prompt_logprobs`` response shapes.

A token's text is its own decode (``tokenizer.decode([id])``) and its ``bytes`` that text's UTF-8,
as vLLM renders them: a token that holds part of a multi-byte character shows U+FFFD.
"""

from __future__ import annotations

from typing import Any

from mmcache.shared.messages import TokenLogprobs

_MAX_CACHED = 4096  # decoded tokens kept per response (bounded: a prompt may hold many distinct ids)


class TokenText:
    """Token id → decoded text, remembered for one response."""

    def __init__(self, tokenizer: Any) -> None:  # a transformers tokenizer
        self._tok = tokenizer
        self._text: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = self._tok.decode([token_id])
            if len(self._text) < _MAX_CACHED:
                self._text[token_id] = text
        return text

    def entry(self, token_id: int, logprob: float) -> dict:
        text = self(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def content(text: TokenText, token_ids: list[int], logprobs: list[TokenLogprobs]) -> list[dict]:
    """OpenAI's ``logprobs.content``: one entry per output token."""
    return [
        {
            **text.entry(token, lp.logprob),
            "top_logprobs": [text.entry(t, v) for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)],
        }
        for token, lp in zip(token_ids, logprobs, strict=True)
    ]


def prompt_logprobs(text: TokenText, token_ids: list[int], logprobs: list[TokenLogprobs | None]) -> list:
    """vLLM's ``prompt_logprobs``: per prompt token ``{token id: {logprob, rank, decoded_token}}`` for
    the token itself and the top k (None for the first token: nothing precedes it)."""
    out: list[dict | None] = []
    for token, lp in zip(token_ids, logprobs, strict=True):
        if lp is None:
            out.append(None)
            continue
        entry = {
            str(t): {"logprob": v, "rank": rank, "decoded_token": text(t)}
            for rank, (t, v) in enumerate(zip(lp.top_ids, lp.top_logprobs, strict=True), start=1)
        }
        entry[str(token)] = {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": text(token)}
        out.append(entry)
    return out
