"""Where ``mmcache serve`` puts the cores: torch threads per stage, and how idle threads wait.

The busy stage gets the cores. A request's work runs through the stages one after another
(processor: decode and resize; encoder: the vision tower, only for media not seen before; LLM:
prefill, then every decode step), and decode is where a server spends most of its time, so the LLM
stage takes every core, and so does the encoder (a first-seen image waits on it alone). The
processor's resizing is light: half the cores. On 2 cores: LLM 2, encoder 2, processor 1.

Stages that overlap (the encoder on one request while the LLM decodes others) then share the cores.
With OpenMP's default wait policy a thread that finishes its part of an operator spins, waiting
for the others; when another process holds the core one of them needs, every operator waits out
scheduler time slices: measured here, 2 threads decoding next to other busy processes ran 5-15x
slower than 1 thread. Passive waiting (``OMP_WAIT_POLICY=PASSIVE``: idle threads sleep) made
2 threads as fast as 1 in that contention, so the launcher sets it for its children unless the
environment already says how OpenMP threads wait.
"""

from __future__ import annotations

from dataclasses import dataclass

STAGES = ("processor", "encoder", "llm")
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


@dataclass(frozen=True, slots=True)
class Placement:
    threads: dict[str, int]  # stage -> torch intra-op threads
    env: dict[str, str]  # set in every stage's environment


def default_threads(cores: int) -> dict[str, int]:
    """Torch threads per stage on a machine (or affinity mask) of ``cores`` cores."""
    cores = max(1, cores)
    return {"processor": max(1, cores // 2), "encoder": cores, "llm": cores}


def place(
    cores: int, environ: dict[str, str], every: int | None, per_stage: dict[str, int | None]
) -> Placement:
    """The placement for ``cores``: ``every`` (``--torch-threads`` or MMCACHE_TORCH_THREADS) sets all
    stages, a stage's own count (``--llm-threads`` ...) overrides it, the rest is the default."""
    base = {s: every for s in STAGES} if every is not None else default_threads(cores)
    threads = {s: per_stage.get(s) or base[s] for s in STAGES}
    env = {} if any(v in environ for v in WAIT_VARIABLES) else {"OMP_WAIT_POLICY": "PASSIVE"}
    return Placement(threads, env)
