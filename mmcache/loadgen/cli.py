"""The flags of ``mmcache bench URL [--compare URL2]`` and the run they describe."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from mmcache.loadgen.report import (
    plot,
    print_ratios,
    print_summary,
    ratios,
    save_results,
    summary,
    write_json,
)
from mmcache.loadgen.runner import run
from mmcache.loadgen.workloads import WORKLOADS, Options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("load a deployment (mmcache bench URL)")
    g.add_argument("--workload", default="repeated-images", choices=WORKLOADS, help="what to send")
    g.add_argument("--num-requests", type=int, default=64, help="requests in all")
    g.add_argument("--concurrency", type=int, default=None, help="most requests in flight (default 8)")
    g.add_argument("--request-rate", type=float, default=None, help="requests started per second (Poisson)")
    g.add_argument("--repeat-ratio", type=float, default=0.5, help="repeated-images: share of repeats")
    g.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request")
    g.add_argument("--image-size", type=int, default=448, help="side of the generated square images")
    g.add_argument("--turns", type=int, default=3, help="multi-turn: requests per conversation")
    g.add_argument("--seed", type=int, default=0, help="makes the workload (same seed, same requests)")
    g.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    g.add_argument(
        "--compare", metavar="URL2", default=None, help="run the same workload there; print ratios"
    )
    g.add_argument("--out", type=Path, default=Path("mmcache-bench"), help="JSON and PNG go to OUT.json/.png")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")


def main(args: argparse.Namespace) -> int:
    if len(args.names) != 1:
        print("mmcache bench URL takes one URL (and --compare URL2)", file=sys.stderr)
        return 2
    try:
        opt = Options(
            args.workload,
            args.num_requests,
            max_tokens=args.max_tokens,
            repeat_ratio=args.repeat_ratio,
            image_size=args.image_size,
            turns=args.turns,
            seed=args.seed,
        )
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    concurrency = args.concurrency if args.concurrency or args.request_rate else 8
    runs, summaries = [], []
    for url in [args.names[0], *([args.compare] if args.compare else [])]:
        result = asyncio.run(run(url, opt, concurrency, args.request_rate, args.model, args.timeout))
        runs.append(result)
        summaries.append(summary(result))
        print_summary(summaries[-1])
    if len(runs) == 2:
        print_ratios(ratios(summaries[0], summaries[1]), runs[0].url, runs[1].url)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    json_path, png_path = args.out.with_suffix(".json"), args.out.with_suffix(".png")
    write_json(json_path, runs, summaries)
    plot(png_path, runs, summaries)
    print(f"wrote {json_path} and {png_path}")
    if args.results_dir is not None:
        print(f"wrote {save_results(args.results_dir, opt, runs, summaries)}")
    return 1 if any(s["failed"] for s in summaries) else 0
