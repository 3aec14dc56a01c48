"""README.md tells the truth about the flags and the commands."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from shared.config import EncoderConfig, LLMConfig, ProcessorConfig, flag_name

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# The README is the front door; flags may be documented on the docs/ pages it leads to.
DOCS = README + "".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))


@pytest.mark.parametrize("cls", [ProcessorConfig, EncoderConfig, LLMConfig], ids=lambda c: c.__name__)
def test_every_flag_is_documented(cls):
    missing = [
        flag_name(f.name)
        for f in dataclasses.fields(cls)
        if f"`{flag_name(f.name)}`" not in DOCS and flag_name(f.name) not in DOCS
    ]
    assert missing == []


def test_the_two_commands_exist_and_ci_runs_the_test_one():
    for script in ("scripts/serve", "scripts/test"):
        assert f"{script}" in README
        assert (ROOT / script).stat().st_mode & 0o111
    assert "scripts/test" in (ROOT / ".ci" / "run").read_text()
