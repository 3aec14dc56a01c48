"""``mmcache serve`` as a real process tree for end-to-end tests (the package's harness, with one
torch thread per stage so that tests sharing the cores do not fight)."""

from __future__ import annotations

from pathlib import Path

from mmcache import harness
from mmcache.harness import alive, descendants, free_port, stage_env, wait_healthy

__all__ = ["Server", "alive", "descendants", "free_port", "stage_env", "wait_healthy"]


class Server(harness.Server):
    def __init__(self, model: Path, *args: str, media_dir: Path | None = None, log: Path | None = None):
        super().__init__(model, *args, media_dir=media_dir, log=log, env={"OMP_NUM_THREADS": "1"})
