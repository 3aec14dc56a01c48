"""``mmcache bench URL`` workloads: deterministic, and shaped as their names say."""

from __future__ import annotations

import pytest

from mmcache.loadgen.workloads import WORKLOADS, Options, conversations


def _urls(messages: list[dict]) -> list[str]:
    return [
        part[part["type"]]["url"]
        for m in messages
        if isinstance(m["content"], list)
        for part in m["content"]
        if part["type"] in ("image_url", "video_url")
    ]


def test_the_same_seed_makes_the_same_requests():
    for workload in WORKLOADS:
        a = conversations(Options(workload, 4, image_size=56, seed=3))
        b = conversations(Options(workload, 4, image_size=56, seed=3))
        assert [t([]) for c in a for t in c.turns[:1]] == [t([]) for c in b for t in c.turns[:1]], workload


def test_repeat_ratio_sets_the_share_of_images_sent_before():
    convs = conversations(Options("repeated-images", 200, image_size=28, repeat_ratio=0.75, seed=1))
    urls = [_urls(c.turns[0]([]))[0] for c in convs]
    repeats = len(urls) - len(set(urls))
    assert 0.65 * 200 < repeats < 0.85 * 200
    unique = conversations(Options("unique-images", 20, image_size=28))
    assert len({_urls(c.turns[0]([]))[0] for c in unique}) == 20


def test_multi_turn_resends_the_history_with_the_answers():
    (conv,) = conversations(Options("multi-turn", 3, turns=3, image_size=28))
    assert len(conv.turns) == 3
    third = conv.turns[2](["first answer", "second answer"])
    assert [m["role"] for m in third] == ["user", "assistant", "user", "assistant", "user"]
    assert third[1]["content"] == "first answer" and third[3]["content"] == "second answer"
    assert _urls(third) == _urls(conv.turns[0]([]))  # the image goes again with every turn


def test_shared_system_prompt_and_text_only():
    convs = conversations(Options("system-prompt", 5, system_words=50))
    systems = {c.turns[0]([])[0]["content"] for c in convs}
    questions = {c.turns[0]([])[1]["content"][0]["text"] for c in convs}
    assert len(systems) == 1 and len(questions) == 5
    assert all(not _urls(c.turns[0]([])) for c in conversations(Options("text", 3)))


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="unknown workload"):
        Options("nope", 1)
    with pytest.raises(ValueError, match="repeat-ratio"):
        Options("repeated-images", 1, repeat_ratio=1.0)
