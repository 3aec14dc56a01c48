"""The machine's physical limits and the LLM stage's compute against them, in one run.

(a) Memory bandwidth: a large bfloat16 copy (bytes read + written per second).
(b) matmul throughput in that dtype: 2048 rows times a 2048² weight through the product the engine uses
    (:class:`~mmcache.shared.linear.Projection`: oneDNN with the weight packed, where the CPU has
    bfloat16; FBGEMM over float16 weights in float32), in FLOP/s.
(c) Decode, ms per token at batch 1 on the ``mid`` checkpoint (Qwen2-0.5B's text shape) in the dtype
    the LLM stage picks by default (bfloat16 where the CPU computes in it, else float32; ``--dtype``),
    through the engine (scheduler, model runner, sampler), against the bandwidth bound: the bytes of
    weights a step reads (every text weight but the embedding table, of which a step reads one row)
    over (a). The bound each step is judged by is measured right after that step (a 256 MiB copy,
    ~15 ms): a shared VM's bandwidth swings by a third within seconds, so a bound measured a round
    earlier judges a step by another machine's state. The ratio is the median over every step.
    Goal: within 1.15x of the bound.
(d) Prefill, tokens/s of a ~512-token prompt, as a fraction of what (b) allows: 2 x parameters
    FLOPs per token (attention's share is small at this length and not counted). As for decode, each
    prefill is judged by the product's throughput measured right after it (the median of three
    2048-row products): on a 2-core AMX Xeon VM two runs a minute apart measured (b) at 0.45 and
    1.71 TFLOP/s (2026-12-07). The ratio is the median over the rounds.

The engine runs in this process with the thread count of this process (``--threads``; default:
every core, as the LLM stage gets by default). ``MMCACHE_BENCH_MODEL`` points at a ``mid``
checkpoint to use; otherwise one is generated (~20 s) and kept. ``MMCACHE_BENCH_RESULTS=FILE`` writes
the figures as JSON with the commit, date, machine and load average. ``--profile DIR`` also writes a
torch profiler table of one decode step and one prefill there. It runs under the environment
``mmcache serve`` gives its stages (:func:`mmcache.placement.stage_env`: how idle OpenMP threads
wait, huge pages), re-executing itself where its own environment lacks it: libgomp reads its
variables when torch loads.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mmcache import results as results_file
from mmcache.benchmarks.common import Budget, Result, measure, median, model_dir, report, say, spread
from mmcache.placement import stage_env

DECODE_GOAL = 1.15
PROMPT_TOKENS = 512
DECODE_TOKENS = 32
COPY_BYTES = 1 << 30  # source size; large against any cache
STEP_COPY_BYTES = 1 << 28  # the copy after each decode step: still ~8x the largest L3 here
MATMUL = 2048


def bandwidth(budget: Budget) -> tuple[float, list[float]]:
    """Bytes/s of a bfloat16 copy, read + written."""
    src = torch.ones(COPY_BYTES // 2, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    times = measure(lambda: dst.copy_(src), budget)
    return 2 * COPY_BYTES / median(times), times


class StepCopy:
    """One bfloat16 copy of STEP_COPY_BYTES between buffers touched once (no page faults timed)."""

    def __init__(self) -> None:
        self.src = torch.ones(STEP_COPY_BYTES // 2, dtype=torch.bfloat16)
        self.dst = self.src.clone()
        self.clean = torch.ones(STEP_COPY_BYTES // 4, dtype=torch.bfloat16)

    def rate(self) -> float:
        """Bytes/s, read + written. Then, untimed, a read of 64 MiB: the copy leaves the caches full
        of written lines, whose write-back would otherwise land in the next decode step."""
        start = time.perf_counter()
        self.dst.copy_(self.src)
        rate = 2 * STEP_COPY_BYTES / (time.perf_counter() - start)
        self.clean.amax()
        return rate


class Matmul:
    """2048 rows times a 2048² weight through the engine's product, in ``dtype``."""

    def __init__(self, dtype: torch.dtype) -> None:
        from mmcache.shared.linear import Projection

        self.x = torch.randn(MATMUL, MATMUL).to(dtype)
        # NOTE: a weight of bfloat16 values, as the checkpoints' are: in float32 it takes the layout
        # the engine gives such a weight (float16 weights where they hold it exactly).
        self.proj = Projection(torch.randn(MATMUL, MATMUL).to(torch.bfloat16).to(dtype))

    def flops(self, budget: Budget) -> tuple[float, list[float]]:
        times = measure(lambda: self.proj(self.x), budget)
        return 2 * MATMUL**3 / median(times), times

    def rate(self) -> float:
        """FLOP/s now: the median of three products."""
        return self.flops(Budget(warmup=0, min_reps=3, max_reps=3, seconds=0))[0]


class Driver:
    """The engine on one checkpoint, fed prompts directly (no ZeroMQ, no processor)."""

    def __init__(self, path: Path, dtype: str):
        from mmcache.llm_stage.engine import Engine
        from mmcache.shared.checkpoint import ModelSpec
        from mmcache.shared.config import LLMConfig

        self.spec = ModelSpec.load(path)
        self.engine = Engine(
            LLMConfig(model=str(path), device="cpu", dtype=dtype, kv_cache_gb=1.0, no_prefix_cache=True),
            self.spec,
        )
        self.next_id = 0
        self.vocab = self.engine.lm.vocab_size

    def sequence(self, n: int, max_tokens: int) -> Any:
        from mmcache.llm_stage.sequence import Sequence
        from mmcache.shared.block_hash import root_hash
        from mmcache.shared.messages import SamplingParams

        self.next_id += 1
        gen = torch.Generator().manual_seed(self.next_id)
        ids = torch.randint(100, 1000, (n,), generator=gen).tolist()
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return Sequence.new(
            self.next_id,
            ids,
            [],
            root_hash(self.spec.weights_fingerprint, None),
            sampling,
            self.engine.max_model_len,
            self.spec.eos_token_ids,
            self.spec.tokens_per_second,
        )

    def generate(
        self, prompt: int, max_tokens: int, after: Callable[[], float] | None = None
    ) -> tuple[float, list[float], list[float]]:
        """(prefill seconds, seconds of each decode step, what ``after()`` returned after each
        step: the prefill's first) of one sequence alone."""
        self.engine.submit(self.sequence(prompt, max_tokens))
        times, afters = [], []
        while self.engine.has_work():
            start = time.perf_counter()
            self.engine.step()
            times.append(time.perf_counter() - start)
            if after is not None:
                afters.append(after())
        return times[0], times[1:], afters


def profile(driver: Driver, out: Path) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    out.mkdir(parents=True, exist_ok=True)
    engine = driver.engine
    engine.submit(driver.sequence(PROMPT_TOKENS, 8))
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    (out / "prefill.txt").write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    engine.step()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    (out / "decode.txt").write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    while engine.has_work():
        engine.step()
    say(f"# profiles written to {out}")


def run(quick: bool = False, threads: int = 0, dtype: str = "auto", profile_dir: str = "") -> list[Result]:
    if threads:
        torch.set_num_threads(threads)
    budget = Budget(warmup=1, min_reps=3, max_reps=10 if quick else 20, seconds=2 if quick else 4)
    bw, bw_times = bandwidth(budget)
    say(f"# bf16 copy of {COPY_BYTES >> 20} MiB: {spread(bw_times)} -> {bw / 1e9:.1f} GB/s (read + write)")
    path = model_dir("qwen2-vl", preset="mid")
    driver = Driver(path, dtype)
    lm = driver.engine.lm
    computed = next(lm.parameters()).dtype  # what ``dtype`` resolved to (``auto``: the engine's choice)
    dtype = str(computed).removeprefix("torch.")
    matmul = Matmul(computed)
    flops, mm_times = matmul.flops(budget)
    say(f"# {dtype} {MATMUL}^2 matmul: {spread(mm_times)} -> {flops / 1e12:.2f} TFLOP/s")
    wbytes, params = lm.step_weight_bytes(), lm.step_parameters()
    say(
        f"# {path}: {params / 1e6:.0f} M text parameters (embedding excluded), "
        f"{wbytes / 1e9:.3f} GB read a step"
    )
    if profile_dir:
        profile(driver, Path(profile_dir))
    rounds = 2 if quick else 4
    driver.generate(PROMPT_TOKENS, 4)  # warm-up
    prefills, decodes, ratios, round_ratios, prefill_ratios = [], [], [], [], []
    copy = StepCopy()
    for _ in range(rounds):
        # after the prefill a product's FLOP/s, after each decode step a copy's bytes/s
        judges = iter([matmul.rate])
        prefill, steps, after = driver.generate(
            PROMPT_TOKENS, DECODE_TOKENS, lambda judges=judges: next(judges, copy.rate)()
        )
        prefills.append(prefill)
        prefill_ratios.append(PROMPT_TOKENS / prefill / (after[0] / (2 * params)))
        decodes.append(median(steps))
        step_ratios = [step / (wbytes / rate) for step, rate in zip(steps, after[1:], strict=True)]
        ratios += step_ratios
        round_ratios.append(median(step_ratios))
    decode = median(decodes)
    bound = wbytes / bw
    say(f"# decode (batch 1, ~{PROMPT_TOKENS} tokens of context): per-round medians {spread(decodes)}")
    say(
        f"# decode over the bound measured right after each step, median of each round's "
        f"{DECODE_TOKENS - 1} steps: {', '.join(f'{r:.2f}' for r in round_ratios)}"
    )
    say(f"# prefill of {PROMPT_TOKENS} tokens: {spread(prefills)}")
    say(
        "# prefill over what the product measured right after it allows, each round: "
        + ", ".join(f"{r:.2f}" for r in prefill_ratios)
    )
    prefill_rate = PROMPT_TOKENS / median(prefills)
    prefill_bound = flops / (2 * params)
    figures = {
        "bandwidth_gbps": bw / 1e9,
        "matmul_tflops": flops / 1e12,
        "weight_gb": wbytes / 1e9,
        "decode_ms": decode * 1e3,
        "decode_bound_ms": bound * 1e3,
        "decode_over_bound_per_round": round_ratios,
        "decode_over_bound_per_step": ratios,
        "prefill_tokens_per_s": prefill_rate,
        "prefill_bound_tokens_per_s": prefill_bound,
        "prefill_over_bound_per_round": prefill_ratios,
        "threads": torch.get_num_threads(),
    }
    results = [
        Result(
            "limits_decode_vs_bandwidth",
            f"decode ms/token at batch 1 on mid ({dtype}) over weight bytes / bandwidth, median of steps "
            f"({decode * 1e3:.1f} ms vs {bound * 1e3:.1f} ms at the start)",
            median(ratios),
            DECODE_GOAL,
            higher_is_better=False,
            details=figures,
        ),
        Result(
            "limits_prefill_vs_matmul",
            f"prefill tokens/s on mid ({dtype}) as a fraction of matmul FLOP/s / (2 x params), median "
            f"of rounds, each judged by a product right after it ({prefill_rate:.0f} vs "
            f"{prefill_bound:.0f} tokens/s at the start)",
            median(prefill_ratios),
            None,
        ),
    ]
    out = os.environ.get("MMCACHE_BENCH_RESULTS")  # a directory: <date>-limits-<commit>.json there
    if out:
        results_file.write(
            Path(out),
            results_file.record("limits", {"dtype": dtype, "checkpoint": str(path), "figures": figures}),
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="the engine's dtype (auto: what the LLM stage picks by default on this machine)",
    )
    parser.add_argument("--profile", default="", metavar="DIR", help="write profiler tables to DIR")
    args = parser.parse_args()
    added = stage_env(dict(os.environ))
    if added:  # as the LLM stage runs: the variables must be there before torch loads
        say(f"# re-running under the stages' environment: {added}")
        argv = [sys.executable, "-m", "mmcache.benchmarks.limits", *sys.argv[1:]]
        os.execve(sys.executable, argv, dict(os.environ) | added)
    start = time.perf_counter()
    results = run(args.quick, args.threads, args.dtype, args.profile)
    say(f"# finished in {time.perf_counter() - start:.1f} s (load average {os.getloadavg()})")
    report(results)


if __name__ == "__main__":
    main()
