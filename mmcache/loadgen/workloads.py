"""What ``mmcache bench URL`` sends: OpenAI chat bodies for each workload, made deterministically
from a seed (media generated on the spot, sent as ``data:`` URLs so any deployment can take them).

A workload is a list of *conversations*; each is one request, except in ``multi-turn``, where
each turn resends the whole history (images included) with the previous answers, as chat
clients do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mmcache.media import data_url, image_bytes, video_bytes

WORKLOADS = ("unique-images", "repeated-images", "videos", "multi-turn", "system-prompt", "text")

_SYLLABLES = [a + b for a in ("", "b", "d", "f", "k", "l", "m", "n", "p", "r", "s", "t") for b in "aeiou"]


@dataclass(frozen=True)
class Options:
    workload: str
    num_requests: int
    max_tokens: int = 32
    repeat_ratio: float = 0.5  # repeated-images: share of requests whose image was sent before
    image_size: int = 448
    video_frames: int = 8
    turns: int = 3  # multi-turn: requests per conversation
    system_words: int = 200  # system-prompt: length of the shared system prompt
    question_words: int = 12
    seed: int = 0

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r}; one of {', '.join(WORKLOADS)}")
        if self.num_requests < 1 or self.max_tokens < 1 or self.turns < 1:
            raise ValueError("--num-requests, --max-tokens and --turns must be at least 1")
        if not 0.0 <= self.repeat_ratio < 1.0:
            raise ValueError(f"--repeat-ratio must be in [0, 1), got {self.repeat_ratio}")


# A turn's messages are built from the answers so far (multi-turn); other workloads ignore them.
Turn = Callable[[list[str]], list[dict]]


@dataclass(frozen=True)
class Conversation:
    turns: list[Turn]


def words(rng: np.random.Generator, n: int) -> str:
    """``n`` random pronounceable words: distinct text for every seed."""
    return " ".join("".join(rng.choice(_SYLLABLES, rng.integers(1, 4))) for _ in range(n))


def _image(seed: int, size: int) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(image_bytes(size, size, seed), "image/png")}}


def _user(*parts: dict) -> dict:
    return {"role": "user", "content": list(parts)}


def _text(t: str) -> dict:
    return {"type": "text", "text": t}


def _single(messages: list[dict]) -> Conversation:
    return Conversation([lambda _answers: messages])


def conversations(opt: Options) -> list[Conversation]:
    rng = np.random.default_rng(opt.seed)
    n = opt.num_requests
    base = opt.seed * 1_000_003  # image seeds of different --seed values do not overlap

    def question() -> dict:
        return _text(words(rng, opt.question_words) + "?")

    if opt.workload == "text":
        return [_single([_user(question())]) for _ in range(n)]
    if opt.workload == "unique-images":
        return [_single([_user(_image(base + i, opt.image_size), question())]) for i in range(n)]
    if opt.workload == "repeated-images":
        out, sent = [], 0
        for _ in range(n):
            repeat = sent > 0 and rng.random() < opt.repeat_ratio
            seed = base + int(rng.integers(0, sent)) if repeat else base + sent
            sent += 0 if repeat else 1
            out.append(_single([_user(_image(seed, opt.image_size), question())]))
        return out
    if opt.workload == "videos":
        size = min(opt.image_size, 224)
        return [
            _single(
                [
                    _user(
                        {
                            "type": "video_url",
                            "video_url": {
                                "url": data_url(
                                    video_bytes(opt.video_frames, size, size, seed=base + i), "video/mp4"
                                )
                            },
                        },
                        question(),
                    )
                ]
            )
            for i in range(n)
        ]
    if opt.workload == "system-prompt":
        system = {"role": "system", "content": words(np.random.default_rng(opt.seed), opt.system_words)}
        return [_single([system, _user(question())]) for _ in range(n)]
    return _multi_turn(opt, rng, base)


def _multi_turn(opt: Options, rng: np.random.Generator, base: int) -> list[Conversation]:
    out = []
    for c in range(-(-opt.num_requests // opt.turns)):
        first = _user(_image(base + c, opt.image_size), _text(words(rng, opt.question_words) + "?"))
        follow_ups = [_user(_text(words(rng, opt.question_words) + "?")) for _ in range(opt.turns - 1)]
        turns = min(opt.turns, opt.num_requests - c * opt.turns)

        def turn(k: int, first=first, follow_ups=follow_ups) -> Turn:
            def messages(answers: list[str]) -> list[dict]:
                history = [first]
                for i in range(k):
                    history += [{"role": "assistant", "content": answers[i]}, follow_ups[i]]
                return history

            return messages

        out.append(Conversation([turn(k) for k in range(turns)]))
    return out


def body(model: str, messages: list[dict], max_tokens: int) -> dict:
    """A streamed chat body (streaming gives the client its time to first token)."""
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
