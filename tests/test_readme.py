"""README.md tells the truth: its two commands exist and CI runs the test one, and a newcomer's
path works as written: the quick-start command serves, and the curl and Python examples, taken
from the README itself (not copied here), get answers from it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mmcache.harness import alive, descendants, free_port, wait_healthy
from mmcache.media import image_bytes

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DEFAULT_URL = "localhost:8000"  # where the README's examples expect the server


def section(title: str) -> str:
    """The README's ``## title`` section, up to the next ``## ``."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.M | re.S)
    assert match, f"README has no section {title!r}"
    return match.group(1)


def blocks(text: str, lang: str) -> list[str]:
    """The fenced code blocks of ``text`` whose info string is ``lang``."""
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, re.M | re.S)


def commands(block: str) -> list[str]:
    """A shell block's command lines, comments dropped."""
    return [c for line in block.splitlines() if (c := line.split("#", 1)[0].strip())]


def test_the_two_commands_exist_and_ci_runs_the_test_one():
    (quick_start,) = blocks(section("Quick start"), "bash")
    assert commands(quick_start) == ["scripts/serve", "scripts/test"]
    for script in commands(quick_start):
        assert (ROOT / script).stat().st_mode & 0o111
    assert "scripts/test" in (ROOT / ".ci" / "run").read_text()


def test_the_examples_are_where_this_test_looks_for_them():
    (curl,) = blocks(section("A request"), "bash")
    (python,) = blocks(section("A request"), "python")
    assert DEFAULT_URL in curl and DEFAULT_URL in python and "photo.png" in curl + python


@contextlib.contextmanager
def quick_start_server(home: Path) -> Iterator[int]:
    """The README's serve command, run as written from the repository root; the port and the
    home directory (where it generates the tiny model) come from the environment, as a user
    may give them."""
    (quick_start,) = blocks(section("Quick start"), "bash")
    serve = commands(quick_start)[0]
    port = free_port()
    env = {
        **os.environ,
        "MMCACHE_PORT": str(port),
        "MMCACHE_HOME": str(home),
        "MMCACHE_LOG_LEVEL": "WARNING",
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.Popen(["bash", "-c", serve], cwd=ROOT, env=env, start_new_session=True)
    tree: set[int] = set()
    try:
        wait_healthy(f"http://127.0.0.1:{port}", [proc])
        tree = descendants(proc.pid)
        yield port
    finally:
        tree |= descendants(proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert not [pid for pid in tree if alive(pid)], "the server left processes behind"


@pytest.mark.e2e
def test_the_quick_start_serves_and_the_readme_examples_get_answers(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "photo.png").write_bytes(image_bytes(320, 240, seed=7))
    (curl,) = blocks(section("A request"), "bash")
    (python,) = blocks(section("A request"), "python")
    with quick_start_server(tmp_path / "home") as port:
        here = f"localhost:{port}"
        out = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", curl.replace(DEFAULT_URL, here)],
            cwd=work,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        answer = json.loads(out.stdout)
        assert answer["choices"][0]["message"]["content"], answer
        assert 1 <= answer["usage"]["completion_tokens"] <= 32  # the example's max_tokens
        assert answer["usage"]["mm_cache"]["processor_misses"] == 1

        out = subprocess.run(
            [sys.executable, "-c", python.replace(DEFAULT_URL, here)],
            cwd=work,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip()  # the streamed answer was printed
