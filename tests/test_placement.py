"""Thread placement of ``mmcache serve``: the busy stages get the cores, flags override it."""

from __future__ import annotations

import argparse
import os

import pytest

from mmcache.launcher import _placement, add_serve_arguments
from mmcache.placement import default_threads, place


def test_on_two_cores_the_llm_stage_gets_both():
    assert default_threads(2) == {"processor": 1, "encoder": 2, "llm": 2}
    assert default_threads(1) == {"processor": 1, "encoder": 1, "llm": 1}
    assert default_threads(16) == {"processor": 8, "encoder": 16, "llm": 16}


def test_passive_waiting_unless_the_environment_says_how_threads_wait():
    assert place(2, {}, None, {}).env == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert place(2, {"OMP_WAIT_POLICY": "ACTIVE"}, None, {}).env == {}
    assert place(2, {"GOMP_SPINCOUNT": "1000"}, None, {}).env == {}


def test_torch_threads_sets_every_stage_and_a_stage_flag_overrides_it():
    assert place(8, {}, 3, {}).threads == {"processor": 3, "encoder": 3, "llm": 3}
    assert place(8, {}, 3, {"llm": 6}).threads == {"processor": 3, "encoder": 3, "llm": 6}
    assert place(2, {}, None, {"encoder": 1}).threads == {"processor": 1, "encoder": 1, "llm": 2}


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


def test_serve_flags_reach_the_placement(monkeypatch):
    monkeypatch.delenv("MMCACHE_TORCH_THREADS", raising=False)
    assert _placement(_args()).threads == default_threads(len(os.sched_getaffinity(0)))
    assert _placement(_args("--torch-threads", "1", "--llm-threads", "2")).threads == {
        "processor": 1,
        "encoder": 1,
        "llm": 2,
    }
    monkeypatch.setenv("MMCACHE_TORCH_THREADS", "1")
    assert _placement(_args()).threads == {"processor": 1, "encoder": 1, "llm": 1}
    with pytest.raises(ValueError, match="--encoder-threads must be >= 1"):
        _placement(_args("--encoder-threads", "0"))
