"""Thread placement of ``mmcache serve``: the busy stages get the cores, flags override it."""

from __future__ import annotations

import argparse
import os

import pytest

from mmcache.launcher import _placement, add_serve_arguments
from mmcache.placement import SMALL_MODEL_BYTES, default_threads, place, weight_bytes


def test_on_two_cores_the_llm_stage_gets_both():
    assert default_threads(2) == {"processor": 1, "encoder": 2, "llm": 2}
    assert default_threads(1) == {"processor": 1, "encoder": 1, "llm": 1}
    assert default_threads(16) == {"processor": 8, "encoder": 16, "llm": 16}


def test_a_model_too_small_to_split_runs_every_stage_on_one_thread():
    one = {"processor": 1, "encoder": 1, "llm": 1}
    assert default_threads(16, SMALL_MODEL_BYTES - 1) == one
    assert (
        default_threads(2, SMALL_MODEL_BYTES)
        == default_threads(2)
        == {"processor": 1, "encoder": 2, "llm": 2}
    )
    assert place(8, {}, None, {"llm": 4}, model_bytes=1 << 20).threads == one | {"llm": 4}
    assert place(8, {}, 3, {}, model_bytes=1 << 20).threads == {"processor": 3, "encoder": 3, "llm": 3}


def test_weight_bytes_sums_the_checkpoint_weight_files(tmp_path, tiny_model):
    assert weight_bytes(tmp_path) is None  # nothing to read: the size is not known
    assert weight_bytes(tmp_path / "absent") is None
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x" * 300)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"x" * 200)
    (tmp_path / "config.json").write_text("{}")
    assert weight_bytes(tmp_path) == 500
    assert 0 < weight_bytes(tiny_model) < SMALL_MODEL_BYTES


def test_a_short_spin_unless_the_environment_says_how_threads_wait():
    huge = {"THP_MEM_ALLOC_ENABLE": "1"}
    assert place(2, {}, None, {}).env == {"GOMP_SPINCOUNT": "1000"} | huge
    assert place(2, {"OMP_WAIT_POLICY": "ACTIVE"}, None, {}).env == huge
    assert place(2, {"GOMP_SPINCOUNT": "50"}, None, {}).env == huge
    assert place(2, {"KMP_BLOCKTIME": "0"}, None, {}).env == huge


def test_huge_pages_unless_the_environment_sets_them():
    assert place(2, {"THP_MEM_ALLOC_ENABLE": "0"}, None, {}).env == {"GOMP_SPINCOUNT": "1000"}


def test_torch_threads_sets_every_stage_and_a_stage_flag_overrides_it():
    assert place(8, {}, 3, {}).threads == {"processor": 3, "encoder": 3, "llm": 3}
    assert place(8, {}, 3, {"llm": 6}).threads == {"processor": 3, "encoder": 3, "llm": 6}
    assert place(2, {}, None, {"encoder": 1}).threads == {"processor": 1, "encoder": 1, "llm": 2}


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


def test_serve_flags_reach_the_placement(monkeypatch, tiny_model):
    monkeypatch.delenv("MMCACHE_TORCH_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert _placement(_args()).threads == default_threads(len(os.sched_getaffinity(0)))
    assert _placement(_args(), str(tiny_model)).threads == {"processor": 1, "encoder": 1, "llm": 1}
    assert _placement(_args("--torch-threads", "1", "--llm-threads", "2")).threads == {
        "processor": 1,
        "encoder": 1,
        "llm": 2,
    }
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as the test harness runs servers
    assert _placement(_args()).threads == {"processor": 1, "encoder": 1, "llm": 1}
    monkeypatch.setenv("MMCACHE_TORCH_THREADS", "3")
    assert _placement(_args()).threads == {"processor": 3, "encoder": 3, "llm": 3}
    with pytest.raises(ValueError, match="--encoder-threads must be >= 1"):
        _placement(_args("--encoder-threads", "0"))


def test_serve_starts_its_stages_with_the_placement(tiny_model):
    """A real ``mmcache serve``: each stage process gets its thread count on its command line and
    passive OpenMP waiting in its environment."""
    from pathlib import Path

    from mmcache.harness import Server

    with Server(tiny_model, "--llm-threads", "2", "--encoder-threads", "1") as server:
        stages = {}
        for pid in server.children:
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
                env = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
            except FileNotFoundError:
                continue
            if "mmcache" in argv and argv[argv.index("mmcache") + 1] in ("llm", "encoder", "processor"):
                stage = argv[argv.index("mmcache") + 1]
                stages[stage] = (int(argv[argv.index("--torch-threads") + 1]), env)
    # The harness runs servers with OMP_NUM_THREADS=1: that sets the stages the flags leave alone.
    assert {name: n for name, (n, _) in stages.items()} == {"llm": 2, "encoder": 1, "processor": 1}
    assert all("GOMP_SPINCOUNT=1000" in env and "THP_MEM_ALLOC_ENABLE=1" in env for _, env in stages.values())
