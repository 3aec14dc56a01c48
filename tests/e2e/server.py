"""``mmcache serve`` as a real process tree for end-to-end tests (the package's harness, with one
torch thread per stage so that tests sharing the cores do not fight)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from mmcache import harness
from mmcache.harness import alive, descendants, free_port, stage_env, wait_healthy

__all__ = ["Server", "alive", "descendants", "free_port", "serving", "stage_env", "wait_healthy"]


class Server(harness.Server):
    def __init__(
        self,
        model: Path,
        *args: str,
        media_dir: Path | None = None,
        log: Path | None = None,
        env: dict[str, str] | None = None,
    ):
        super().__init__(
            model, *args, media_dir=media_dir, log=log, env={"OMP_NUM_THREADS": "1", **(env or {})}
        )


@contextlib.contextmanager
def serving(model: Path, *args: str, **kwargs) -> Iterator[Server]:
    """A :class:`Server` for the block (a fixture's or a test's), then stopped: it must leave no
    process behind."""
    server = Server(model, *args, **kwargs)
    try:
        yield server
    finally:
        assert server.stop() == set()
