"""Incremental detokenization with stop strings.

Decoding a short window of recent tokens (not the whole output) keeps each
step O(1); text is held back while the window ends inside a multi-byte
character (U+FFFD) or could still be the start of a stop string.
"""

from __future__ import annotations

_WINDOW = 6  # tokens of left context when decoding the newest ones


class Detokenizer:
    def __init__(self, tokenizer, stop: list[str]):
        self._tok = tokenizer
        self._special = set(tokenizer.all_special_ids)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # all text decoded so far (stop string removed once matched)
        self._prefix = 0  # window start in token_ids
        self._read = 0  # tokens already turned into text
        self._sent = 0  # characters of text already handed out
        self.stopped = False

    def add(self, token_ids: list[int]) -> None:
        """Append generated tokens; sets :attr:`stopped` when a stop string appears."""
        if not self.stopped:
            self.token_ids += token_ids
            self._advance(final=False)

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
        for stop in self._stop:
            at = self.text.find(stop, start)
            if at != -1:
                self.text = self.text[:at]
                self.stopped = True
                return

    def safe_delta(self) -> str:
        """Text that can no longer turn into a stop string."""
        return self._take(len(self.text) if self.stopped else len(self.text) - self._hold)

    def _take(self, upto: int) -> str:
        if upto <= self._sent:
            return ""
        out = self.text[self._sent : upto]
        self._sent = upto
        return out
