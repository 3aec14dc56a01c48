"""Which compiled kernels the vision tower's own forward runs on (:mod:`.vision_rotary`,
:mod:`.vision_attention`).

Both replace a function every model of a family's class calls (the module's rotary function, the
attention named by the config). :class:`~.vision.VisionTower` sets the kernels with :func:`active`
around its own forward only, so any other model of that class in the process (a reference in a
test) runs transformers' functions untouched. A context variable, not a global: a forward on
another thread or task sees its own setting.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from mmcache.shared import cpu_kernels

_ACTIVE: ContextVar[cpu_kernels.Kernels | None] = ContextVar("mmcache_tower_kernels", default=None)


def current() -> cpu_kernels.Kernels | None:
    """The kernels :func:`active` holds here (None outside it: the originals run)."""
    return _ACTIVE.get()


@contextmanager
def active(lib: cpu_kernels.Kernels | None) -> Iterator[None]:
    """Run the tower's replaced functions through ``lib`` inside the block (None: the originals)."""
    token = _ACTIVE.set(lib)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
