"""Where ``mmcache serve`` puts the cores: torch threads per stage, and how idle threads wait.

The busy stage gets the cores. A request's work runs through the stages one after another
(processor: decode and resize; encoder: the vision tower, only for media not seen before; LLM:
prefill, then every decode step), and decode is where a server spends most of its time, so the LLM
stage takes every core, and so does the encoder (a first-seen image waits on it alone). The
processor's resizing is light: half the cores. On 2 cores: LLM 2, encoder 2, processor 1.

Except for a model too small to split: below ``SMALL_MODEL_BYTES`` of weights every stage takes one
thread. Its operators last microseconds, and a parallel one first wakes the other thread (torch's
fp32 product of one row by a 128x384 weight: 12 us on one thread, 66 us on two, on the 2-core
Intel Xeon with AMX, 2026-12-06), so the tiny test checkpoint (5 MB) decoded at 4.2-5.4 ms a token
on two threads against 2.3-2.9 ms on one (served, short prompt) and served 16 concurrent text
requests at 1.9-2.2k against 2.7-3.0k tokens/s. ``mid`` (784 MB) is faster on two; sizes between
were not measured.

Stages that overlap (the encoder on one request while the LLM decodes others) then share the cores.
How an OpenMP thread waits for the next operator decides what that sharing costs. libgomp's
default spins 300,000 rounds after each parallel operator (~10 ms on the 2-core AMD EPYC VM): next
to another busy process, a thread spinning at the end of an operator holds the core its partner
needs, and decoding with 2 threads ran 5-15x slower than with 1. Sleeping at once
(``OMP_WAIT_POLICY=PASSIVE``) fixes that but makes every operator wake the sleeping thread: a
decode step on a 24-layer model is ~100 parallel operators (each weight product), and the
wake-ups cost it ~30% on a quiet 2-core VM (~100 us each). The launcher sets
``GOMP_SPINCOUNT=1000`` for its children, a middle between the two: next to a process with 2
busy threads, decode in process took 97 ms on the EPYC
(default spin 214-237, PASSIVE 83-100), and served end to end it was within 4% of
``GOMP_SPINCOUNT=30000`` on every row and ahead of PASSIVE on decode (95 vs 107 ms). A round is
one ``pause`` instruction, whose cost differs by CPU (~10 ns on a 2-core Intel Xeon with AMX,
2026-12-03), so 1,000 rounds bridge less of a step's gaps there: its decode step (``mid``, bf16,
in process) took 52-54 ms with 1,000 against 42-46 ms with 30,000 on a quiet machine, but 73 ms
against 92 ms next to a process with 2 busy threads (PASSIVE: 54-56 and 75 ms). The count stays
at 1,000, the better of the two under load. An environment that already says how OpenMP threads
wait is left alone.

Large tensors get transparent huge pages (torch's ``THP_MEM_ALLOC_ENABLE=1``, for allocations of
2 MiB and more) unless the environment sets that variable: a decode step reads every weight once,
and with 4 KiB pages the weight products ran ~10% slower (the 97 products of a ``mid`` step on
that Xeon: 36.2 against 33.3 ms; the step, in process: 49.0 against 44.8-45.9 ms).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

STAGES = ("processor", "encoder", "llm")
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
SPIN_ROUNDS = 1000  # GOMP_SPINCOUNT: how long an idle OpenMP thread spins before it sleeps
HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"  # torch: madvise huge pages for allocations of 2 MiB and more
SMALL_MODEL_BYTES = 64 << 20  # weights below this: one thread per stage (operators too small to split)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


@dataclass(frozen=True, slots=True)
class Placement:
    threads: dict[str, int]  # stage -> torch intra-op threads
    env: dict[str, str]  # set in every stage's environment


def default_threads(cores: int, model_bytes: int | None = None) -> dict[str, int]:
    """Torch threads per stage on a machine (or affinity mask) of ``cores`` cores, for a model of
    ``model_bytes`` of weights (None: not known, taken as large)."""
    if model_bytes is not None and model_bytes < SMALL_MODEL_BYTES:
        cores = 1
    cores = max(1, cores)
    return {"processor": max(1, cores // 2), "encoder": cores, "llm": cores}


def weight_bytes(model_dir: str | Path) -> int | None:
    """The bytes of a checkpoint directory's weight files (None when it has none to read)."""
    try:
        files = [f for f in Path(model_dir).iterdir() if f.name.endswith(WEIGHT_SUFFIXES)]
        return sum(f.stat().st_size for f in files) if files else None
    except OSError:
        return None


def place(
    cores: int,
    environ: dict[str, str],
    every: int | None,
    per_stage: dict[str, int | None],
    model_bytes: int | None = None,
) -> Placement:
    """The placement for ``cores``: ``every`` (``--torch-threads`` or MMCACHE_TORCH_THREADS) sets all
    stages, a stage's own count (``--llm-threads`` ...) overrides it, the rest is the default."""
    base = {s: every for s in STAGES} if every is not None else default_threads(cores, model_bytes)
    threads = {s: per_stage.get(s) or base[s] for s in STAGES}
    return Placement(threads, stage_env(environ))


def stage_env(environ: dict[str, str]) -> dict[str, str]:
    """What a stage's environment gets added: the spin and huge pages, where ``environ`` is silent."""
    env = {} if any(v in environ for v in WAIT_VARIABLES) else {"GOMP_SPINCOUNT": str(SPIN_ROUNDS)}
    if HUGE_PAGES not in environ:
        env[HUGE_PAGES] = "1"
    return env
