"""Incremental detokenization against the tiny checkpoint's real tokenizer.

The reference is always ``tokenizer.decode(all ids, skip_special_tokens=True)``: streaming
pieces (``safe_delta`` after every ``add``, then ``flush``) must concatenate to it.
"""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from mmcache.processor.detokenizer import Detokenizer

_VOCABULARY = (
    "The harbor town woke slowly . Fishermen hauled wet nets across the cobbled quay , while gulls argued "
    "over scraps of herring ; a baker pulled golden loaves from a brick oven . Lisbon Montreal Nairobi "
    "Osaka Valparaíso héllo wörld naïve café 日本語 中文 한국어 Ελληνικά русский 🙂 🚀 👩‍👩‍👧 "
    "x=1+2 ( ) [ ] { } \n \t 123 4567 it's don't"
)
WORDS = _VOCABULARY.split(" ")


@pytest.fixture(scope="module")
def tok(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def stream(tok, ids: list[int], rng: random.Random, max_step: int, stop: list[str] | None = None):
    """Feed ``ids`` 1..max_step at a time; returns (pieces, detokenizer)."""
    detok = Detokenizer(tok, stop or [])
    pieces: list[str] = []
    i = 0
    while i < len(ids) and not detok.stopped:
        n = rng.randint(1, max_step)
        detok.add(ids[i : i + n])
        i += n
        pieces.append(detok.safe_delta())
    pieces.append(detok.flush())
    return pieces, detok


def random_text(rng: random.Random, n_words: int) -> str:
    return "".join(rng.choice(WORDS) + rng.choice(["", " ", " ", "\n"]) for _ in range(n_words))


def reference(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)


def test_tokenizer_splits_non_ascii_characters_across_tokens(tok):
    """Precondition of the multi-byte tests: some characters need several byte tokens."""
    ids = tok.encode("日本語 🙂", add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("max_step", [1, 2, 3, 5, 8])
def test_stream_of_text_tokens_equals_decode(tok, max_step):
    rng = random.Random(1000 + max_step)
    for _ in range(60):
        ids = tok.encode(random_text(rng, rng.randint(1, 30)), add_special_tokens=False)
        pieces, _ = stream(tok, ids, rng, max_step)
        assert "".join(pieces) == reference(tok, ids)


@pytest.mark.parametrize("max_step", [1, 3, 7])
def test_special_tokens_are_skipped(tok, max_step):
    rng = random.Random(max_step)
    specials = list(tok.all_special_ids)
    for _ in range(40):
        ids = tok.encode(random_text(rng, rng.randint(1, 20)), add_special_tokens=False)
        for _ in range(rng.randint(1, 4)):
            ids.insert(rng.randint(0, len(ids)), rng.choice(specials))
        pieces, _ = stream(tok, ids, rng, max_step)
        assert "".join(pieces) == reference(tok, ids)


@pytest.mark.parametrize("max_step", [1, 2, 4, 6])
def test_stream_of_arbitrary_token_ids_equals_decode(tok, max_step):
    """Any id sequence a model may emit (lone byte tokens, special tokens) decodes exactly as the
    tokenizer does once generation ends, whatever the step size."""
    rng = random.Random(max_step)
    for _ in range(80):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 40))]
        pieces, _ = stream(tok, ids, rng, max_step)
        assert "".join(pieces) == reference(tok, ids), ids


def test_flush_keeps_text_held_behind_an_incomplete_character(tok):
    """Generation may end (max_tokens) in the middle of a multi-byte character; the complete text
    before it must still be delivered."""
    ids = tok.encode("hello world 日本", add_special_tokens=False)
    assert "\ufffd" in tok.decode(ids[-1:])  # ends with a byte of 本
    cut = ids[:-1]  # generation stopped one byte short of the last character
    detok = Detokenizer(tok, [])
    detok.add(cut)
    text = detok.safe_delta() + detok.flush()
    assert text.startswith("hello world 日")
    assert text == reference(tok, cut)


def test_multibyte_characters_never_stream_as_replacement_chars(tok):
    text = "héllo wörld 日本語 🙂 and 👩‍👩‍👧 again: naïve café 中文 🚀"
    ids = tok.encode(text, add_special_tokens=False)
    assert reference(tok, ids) == text
    for max_step in (1, 2, 3):
        pieces, _ = stream(tok, ids, random.Random(max_step), max_step)
        assert not any("\ufffd" in p for p in pieces), pieces
        assert "".join(pieces) == text


def test_one_token_at_a_time_emits_text_as_soon_as_it_is_complete(tok):
    ids = tok.encode("the harbor town woke slowly", add_special_tokens=False)
    detok = Detokenizer(tok, [])
    emitted = ""
    for i, token in enumerate(ids):
        detok.add([token])
        emitted += detok.safe_delta()
        assert emitted == reference(tok, ids[: i + 1])  # no stop strings: nothing is held back
    assert detok.flush() == ""
    assert detok.token_ids == ids


# --- stop strings ---------------------------------------------------------------------------


def check_stop(tok, ids: list[int], stop: list[str], rng: random.Random, max_step: int) -> None:
    full = reference(tok, ids)
    hits = [full.find(s) for s in stop if s in full]
    pieces, detok = stream(tok, ids, rng, max_step, stop)
    text = "".join(pieces)
    if hits:
        assert detok.stopped
        assert text == full[: min(hits)]
    else:
        assert not detok.stopped
        assert text == full
    # safe_delta pieces never reveal the beginning of a stop string that later completes
    emitted = ""
    for piece in pieces:
        emitted += piece
        assert emitted == text[: len(emitted)]
    for s in stop:
        assert s not in text


@pytest.mark.parametrize("max_step", [1, 2, 4])
def test_stop_strings_cut_the_text(tok, max_step):
    rng = random.Random(50 + max_step)
    for _ in range(80):
        ids = tok.encode(random_text(rng, rng.randint(3, 25)), add_special_tokens=False)
        full = reference(tok, ids)
        start = rng.randrange(len(full))
        stop = [full[start : start + rng.randint(1, 8)]]
        if rng.random() < 0.5:
            stop.append("never-appears-at-all")
        check_stop(tok, ids, stop, rng, max_step)


def test_stop_string_spanning_several_tokens(tok):
    text = "the baker pulled golden loaves from a brick oven"
    stop = "golden loaves from"
    final = "the baker pulled "
    ids = tok.encode(text, add_special_tokens=False)
    # the stop string is longer than any single token, so it spans several
    assert max(len(tok.decode([i])) for i in ids) < len(stop)
    for max_step in (1, 2, 3):
        detok = Detokenizer(tok, [stop])
        emitted = ""
        rng = random.Random(max_step)
        i = 0
        while i < len(ids) and not detok.stopped:
            n = rng.randint(1, max_step)
            detok.add(ids[i : i + n])
            i += n
            emitted += detok.safe_delta()
            # at every step only final text is out: not one character of the stop string
            assert final.startswith(emitted)
        assert detok.stopped
        assert emitted + detok.flush() == final


def test_no_partial_stop_string_is_ever_emitted(tok):
    """Text that might still become the stop string stays held while it is incomplete."""
    text = "over scraps of herring; a baker"
    stop = "scraps of herring"
    ids = tok.encode(text, add_special_tokens=False)
    detok = Detokenizer(tok, [stop])
    emitted = ""
    for token in ids:
        detok.add([token])
        emitted += detok.safe_delta()
        assert "over ".startswith(emitted)
        if detok.stopped:
            break
    assert detok.stopped
    assert emitted + detok.flush() == "over "


def test_text_that_only_resembles_the_stop_string_is_released(tok):
    ids = tok.encode("the harbor town", add_special_tokens=False)
    detok = Detokenizer(tok, ["harbour"])
    out = ""
    for token in ids:
        detok.add([token])
        out += detok.safe_delta()
    out += detok.flush()
    assert not detok.stopped
    assert out == "the harbor town"


def test_earliest_of_several_stop_strings_wins(tok):
    ids = tok.encode("alpha beta gamma delta", add_special_tokens=False)
    pieces, detok = stream(tok, ids, random.Random(0), 2, ["delta", "beta", "gamma"])
    assert detok.stopped
    assert "".join(pieces) == "alpha "


def test_stop_at_the_very_start_and_add_after_stop_is_ignored(tok):
    ids = tok.encode("stop here please", add_special_tokens=False)
    detok = Detokenizer(tok, ["stop"])
    detok.add(ids)
    assert detok.stopped
    assert detok.safe_delta() + detok.flush() == ""
    detok.add(tok.encode(" more", add_special_tokens=False))
    assert detok.flush() == ""


def test_stop_string_with_multibyte_characters(tok):
    text = "café 日本語 🙂 done"
    ids = tok.encode(text, add_special_tokens=False)
    for max_step in (1, 2, 3):
        pieces, detok = stream(tok, ids, random.Random(max_step), max_step, ["語 🙂"])
        assert detok.stopped
        assert "".join(pieces) == "café 日本"
        assert not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("max_step", [1, 3, 50])
def test_tokens_end_at_the_one_that_completes_the_stop_string(tok, max_step):
    """vLLM's rule: the answer's tokens run through the token in which the stop string completes
    (its text is cut there); the tokens after it are dropped, even within one ``add``."""
    ids = tok.encode("the baker pulled golden loaves from a brick oven", add_special_tokens=False)
    completes = next(k for k in range(1, len(ids) + 1) if "golden loaves" in reference(tok, ids[:k]))
    detok = Detokenizer(tok, ["golden loaves"])
    kept = []
    for i in range(0, len(ids), max_step):
        kept.append(detok.add(ids[i : i + max_step]))
    assert detok.stopped and detok.token_ids == ids[:completes]
    assert sum(kept) == completes
    assert detok.flush() == "the baker pulled "


@pytest.mark.parametrize("max_step", [1, 4, 50])
def test_a_stop_string_within_min_tokens_is_part_of_the_answer(tok, max_step):
    """vLLM's rule: a stop string counts only once the output has more than ``min_tokens``
    tokens; one completed before that stays in the text, and a later one still stops it."""
    ids = tok.encode("oven then more oven and the rest", add_special_tokens=False)
    first = next(k for k in range(1, len(ids) + 1) if "oven" in reference(tok, ids[:k]))
    second = next(k for k in range(first + 1, len(ids) + 1) if reference(tok, ids[:k]).count("oven") == 2)
    for min_tokens, stops_at, text in ((first - 1, first, ""), (first, second, "oven then more ")):
        detok = Detokenizer(tok, ["oven"], min_tokens)
        for i in range(0, len(ids), max_step):
            detok.add(ids[i : i + max_step])
        assert detok.stopped and detok.token_ids == ids[:stops_at], min_tokens
        assert detok.flush() == text
    detok = Detokenizer(tok, ["oven"], len(ids))  # no stop string counts: the whole text
    detok.add(ids)
    assert not detok.stopped and detok.flush() == reference(tok, ids)
