"""Every subcommand's --help renders (argparse formats each flag's help text)."""

from __future__ import annotations

import pytest

from mmcache.cli import _parser


@pytest.mark.parametrize(
    "command", ["serve", "processor", "encoder", "llm", "bench", "batch", "make-tiny-model"]
)
def test_help_renders(command: str, capsys):
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args([command, "--help"])
    assert exit_.value.code == 0
    assert "--" in capsys.readouterr().out


def test_a_bad_heartbeat_timeout_stops_a_stage_with_a_clear_error(monkeypatch, capsys):
    from mmcache.cli import main

    monkeypatch.setenv("MMCACHE_HEARTBEAT_TIMEOUT", "soon")
    with pytest.raises(SystemExit) as exit_:
        main(["llm", "--model", "/nonexistent"])
    assert exit_.value.code == 2
    assert "MMCACHE_HEARTBEAT_TIMEOUT='soon': not a number of seconds" in capsys.readouterr().err
