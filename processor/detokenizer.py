"""Incremental detokenization with stop strings.

Decoding a short window of recent tokens (not the whole output) keeps each
step O(1); text is held back while the window ends inside a multi-byte
character (U+FFFD) or could still be the start of a stop string.
"""

from __future__ import annotations

_WINDOW = 6  # tokens of left context when decoding the newest ones


class Detokenizer:
    def __init__(self, tokenizer, stop: list[str], min_tokens: int = 0):
        self._tok = tokenizer
        self._special = set(tokenizer.all_special_ids)
        self._stop = stop
        # A stop string ends the answer only once it has more than min_tokens tokens (vLLM's rule):
        # one completed before that is part of the answer.
        self._min_tokens = min_tokens
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # all text decoded so far (stop string removed once matched)
        self._prefix = 0  # window start in token_ids
        self._read = 0  # tokens already turned into text
        self._sent = 0  # characters of text already handed out
        self.stopped = False

    def add(self, token_ids: list[int]) -> int:
        """Append generated tokens; sets :attr:`stopped` when a stop string appears. Returns how
        many of them are part of the answer: with stop strings, the tokens after the one that
        completes a stop string are not (vLLM's rule; :attr:`token_ids` ends with that token)."""
        if self.stopped:
            return 0
        if not self._stop:
            self.token_ids += token_ids
            self._advance(final=False)
            return len(token_ids)
        # NOTE: one token at a time, so that the token that completes a stop string is known.
        for kept, token in enumerate(token_ids, start=1):
            self.token_ids.append(token)
            self._advance(final=False)
            if self.stopped:
                return kept
        return len(token_ids)

    def flush(self) -> str:
        """All remaining text: call once generation has ended (an incomplete last character
        decodes as U+FFFD, exactly as a whole-output decode would)."""
        if not self.stopped and self._read < len(self.token_ids):
            self._advance(final=True)
        return self._take(len(self.text))

    def _advance(self, final: bool) -> None:
        window = [t for t in self.token_ids[self._prefix :] if t not in self._special]
        read = [t for t in self.token_ids[self._prefix : self._read] if t not in self._special]
        full = self._tok.decode(window, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        if full.endswith("\ufffd") and not final:
            return  # wait for the rest of the character
        seen = self._tok.decode(read, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        new = full[len(seen) :]
        self._prefix = max(self._prefix, len(self.token_ids) - _WINDOW)
        self._read = len(self.token_ids)
        start = max(0, len(self.text) - self._hold)
        self.text += new
        if len(self.token_ids) <= self._min_tokens:
            return
        found = [at for stop in self._stop if (at := self.text.find(stop, start)) != -1]
        if found:
            self.text = self.text[: min(found)]  # the earliest stop string wins
            self.stopped = True

    def safe_delta(self) -> str:
        """Text that can no longer turn into a stop string."""
        return self._take(len(self.text) if self.stopped else len(self.text) - self._hold)

    def _take(self, upto: int) -> str:
        if upto <= self._sent:
            return ""
        out = self.text[self._sent : upto]
        self._sent = upto
        return out
