"""The ``mmcache`` command: thin dispatch to the stages, the launcher and the tools."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mmcache.shared.config import EncoderConfig, LLMConfig, ProcessorConfig, add_arguments, from_args
from mmcache.tiny_model import PRESETS, TINY_MODEL_ARCHS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmcache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run all three stages on this machine")
    from mmcache.launcher import add_serve_arguments

    add_serve_arguments(serve)
    for name, cls, text in (
        ("processor", ProcessorConfig, "run the HTTP processor stage"),
        ("encoder", EncoderConfig, "run the vision encoder stage"),
        ("llm", LLMConfig, "run the language model stage"),
    ):
        add_arguments(sub.add_parser(name, help=text), cls)

    tiny = sub.add_parser("make-tiny-model", help="generate the tiny test checkpoint offline")
    tiny.add_argument("dir")
    tiny.add_argument("--arch", default="qwen2-vl", choices=TINY_MODEL_ARCHS)
    tiny.add_argument(
        "--preset",
        default="tiny",
        choices=PRESETS,
        help="size: tiny (1.3 M parameters, tests), mid (Qwen2-0.5B's text shape, ~410 M), "
        "2b (Qwen2-VL-2B's / Qwen3-VL-2B's dimensions, bfloat16)",
    )

    ping = sub.add_parser("ping", help="exit 0 when the stage at ADDRESS answers (health checks)")
    ping.add_argument("address", help="e.g. tcp://127.0.0.1:5556")
    ping.add_argument("--timeout", type=float, default=5.0)

    from mmcache.batch_client import add_arguments as add_batch_arguments

    add_batch_arguments(
        sub.add_parser("batch", help="run a JSONL file as a batch job on a server, with progress")
    )

    bench = sub.add_parser(
        "bench", help="load a deployment (bench URL), or run the built-in benchmarks and print their ratios"
    )
    bench.add_argument("names", nargs="*", help="a deployment's URL, or benchmarks to run (default: all)")
    bench.add_argument("--quick", action="store_true", help="the short versions (seconds, not minutes)")
    bench.add_argument(
        "--results-dir",
        type=Path,
        default=None,
        help="also write the results as one JSON file there, with commit, date and machine "
        "(e.g. benchmarks/results)",
    )
    from mmcache.loadgen.cli import add_arguments as add_load_arguments

    add_load_arguments(bench)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command in ("serve", "processor", "encoder", "llm"):
        from mmcache.shared.loop_socket import heartbeat_timeout_ms

        try:
            heartbeat_timeout_ms()  # a bad MMCACHE_HEARTBEAT_TIMEOUT stops a stage here, named
        except ValueError as exc:
            parser.error(str(exc))
    if args.command == "serve":
        from mmcache.launcher import serve

        sys.exit(serve(args))
    elif args.command == "processor":
        from mmcache.processor.app import run as run_processor

        run_processor(from_args(ProcessorConfig, args))
    elif args.command == "encoder":
        from mmcache.encoder_stage.service import run as run_encoder

        run_encoder(from_args(EncoderConfig, args))
    elif args.command == "llm":
        from mmcache.llm_stage.service import run as run_llm

        run_llm(from_args(LLMConfig, args))
    elif args.command == "make-tiny-model":
        from mmcache.tiny_model import make_tiny_model

        print(make_tiny_model(args.dir, args.arch, args.preset))
    elif args.command == "bench" and args.names and args.names[0].startswith(("http://", "https://")):
        from mmcache.loadgen.cli import main as load

        sys.exit(load(args))
    elif args.command == "batch":
        from mmcache.batch_client import run as run_batch

        sys.exit(run_batch(args))
    elif args.command == "ping":
        from mmcache.ping import ping

        sys.exit(ping(args.address, args.timeout))
    elif args.command == "bench":
        from mmcache.bench import run_benchmarks

        sys.exit(run_benchmarks(args.names, quick=True if args.quick else None, results_dir=args.results_dir))
