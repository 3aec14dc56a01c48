"""Processor time per image, processor-cache hit vs miss, for a 1024x1024 PNG (goal: hit >= 50x cheaper).

Two figures. Per image (the goal): the work the processor does for one image once its bytes are
in hand — a hit is media_key + lookup, a miss is media_key + decode + convert/resize + chunk hash
(the functions the pipeline calls). Per request: ``Pipeline.prepare`` as a whole, where the
prompt build costs the same on both sides; a hit does not read the file (a repeated file whose
status has settled is known by its path and stat signature), a miss reads it in a thread.

In-process: a ``processor.pipeline.Pipeline`` built as ``processor/app.py`` builds it
(``MediaSource`` with an allowed directory, ``Preprocessor``, ``PromptBuilder``), timing
``Pipeline.prepare(parse_chat_request(body))`` for a chat request with one ``file://``
image and a short question. A miss is a fresh image every iteration; a hit is the same
image again. Misses and hits are interleaved. The miss is also measured with the cache
disabled (``processor_cache_gb=0``, the same image each time) as a cross-check, and the
miss is broken down into fetch / media hash / decode / convert+resize / chunk hash /
prompt build.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path

from mmcache.benchmarks.common import (
    Budget,
    Result,
    fmt_time,
    interleaved,
    main,
    measure,
    median,
    model_dir,
    say,
    spread,
)

GOAL = 50.0
SIZE = 1024


def _body(url: str) -> dict:
    return {
        "model": "bench",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "What is in this picture? Describe it in one sentence."},
                ],
            }
        ],
        "max_tokens": 16,
    }


def _pipeline(model: Path, media_dir: Path, **overrides):
    from mmcache.processor.media_source import MediaSource
    from mmcache.processor.pipeline import Pipeline
    from mmcache.processor.preprocess import Preprocessor
    from mmcache.processor.prompt import PromptBuilder
    from mmcache.shared.checkpoint import ModelSpec
    from mmcache.shared.config import ProcessorConfig

    cfg = ProcessorConfig(model=str(model), allowed_local_media_path=str(media_dir), **overrides)
    pre = Preprocessor(cfg.model, cfg.video_fps, cfg.max_video_frames)
    prompts = PromptBuilder(ModelSpec.load(cfg.model))
    source = MediaSource(cfg.allowed_dirs, cfg.max_media_bytes, None)
    return Pipeline(cfg, source, pre, prompts)


def run(quick: bool = False) -> list[Result]:
    from mmcache.media import image_bytes
    from mmcache.processor.media_decode import decode_image
    from mmcache.processor.media_source import SETTLED_SECONDS
    from mmcache.processor.request import parse_chat_request
    from mmcache.shared.keys import chunk_key, media_key

    model = model_dir()
    num_misses = 3 if quick else 12
    tmp = Path(tempfile.mkdtemp(prefix="mmcache-bench-media-"))
    loop = asyncio.new_event_loop()
    pipelines = []
    try:
        say(f"# processor cache: {SIZE}x{SIZE} PNG, {num_misses} fresh images (+1 warm-up)")
        paths = []
        for seed in range(num_misses + 2):  # 0: the hit image, 1: warm-up miss, 2..: timed misses
            path = tmp / f"img{seed}.png"
            path.write_bytes(image_bytes(SIZE, SIZE, seed=seed))
            paths.append(path)
        say(f"  PNG size {paths[0].stat().st_size / 1e6:.2f} MB")
        time.sleep(SETTLED_SECONDS)  # the hit image's status settles (written files usually have)
        urls = [f"file://{p}" for p in paths]
        pipe = _pipeline(model, tmp)
        off = _pipeline(model, tmp, processor_cache_gb=0.0)
        pipelines += [pipe, off]

        def prepare(p, url: str):
            prepared = loop.run_until_complete(p.prepare(parse_chat_request(_body(url))))
            p.done(prepared)  # the request ends: its entries may be evicted again
            return prepared

        # warm-up: the hit image goes into the cache, one miss warms decode/resize
        first = prepare(pipe, urls[0])
        prepare(pipe, urls[1])
        prepare(off, urls[0])
        assert prepare(pipe, urls[0]).report.processor_hits == 1

        reads = pipe.source.file_reads
        misses = iter(urls[2:])
        reports = []

        def miss() -> None:
            reports.append(prepare(pipe, next(misses)).report)

        def hit() -> None:
            reports.append(prepare(pipe, urls[0]).report)

        miss_t, hit_t = interleaved(
            [miss, hit], Budget(warmup=0, min_reps=num_misses, max_reps=num_misses, seconds=0)
        )
        assert sum(r.processor_misses for r in reports) == num_misses, reports
        assert sum(r.processor_hits for r in reports) == num_misses, reports
        extra_hits = measure(lambda: prepare(pipe, urls[0]), Budget(2, 20, 200 if quick else 1000, 1.0))
        hit_all = hit_t + extra_hits
        off_t = measure(lambda: prepare(off, urls[0]), Budget(1, 3, num_misses, 5.0))

        say(f"  miss (fresh image): {spread(miss_t)}")
        say(f"  miss (cache off, same image): {spread(off_t)}")
        say(f"  hit: {spread(hit_all)}")
        say(f"  file reads: {pipe.source.file_reads - reads} for {num_misses} misses and {len(hit_all)} hits")

        # the miss, step by step (same functions the pipeline calls)
        pre, source, prompts = pipe.pre, pipe.source, pipe.prompts
        fp = pre.fingerprint
        layout = first.media[0]
        messages = parse_chat_request(_body(urls[0])).messages
        datas = [p.read_bytes() for p in paths[2:]]
        images = [decode_image(d, pipe.limits, "bench") for d in datas]
        step_budget = Budget(1, 3, 20 if quick else 60, 0.5 if quick else 2.0)
        pixels = layout.chunks[0].pixels
        steps = {
            "fetch (file:// read, thread hop)": lambda: loop.run_until_complete(source.fetch(urls[2], "b")),
            "media_key (hash of raw bytes)": lambda: media_key(None, "image", datas[0], fp),
            "decode (pillow)": lambda: decode_image(datas[0], pipe.limits, "bench"),
            "convert + resize + chunk hash": lambda: pre.image(images[0], None),
            "chunk_key (hash of resized pixels)": lambda: chunk_key(None, pixels.numpy(), pixels.shape, fp),
            "prompt build (template + tokenize)": lambda: prompts.build(messages, [layout]),
        }
        say(f"  miss breakdown (median; resized to {tuple(pixels.shape)}, {layout.num_tokens} tokens):")
        costs = {}
        for name, fn in steps.items():
            costs[name] = median(measure(fn, step_budget))
            say(f"    {name:38s} {fmt_time(costs[name]):>10s}")
        resize = costs["convert + resize + chunk hash"] - costs["chunk_key (hash of resized pixels)"]
        say(f"    {'  of which convert + resize':38s} {fmt_time(resize):>10s}")
        say(f"    {'sum':38s} {fmt_time(sum(costs.values())):>10s}")

        def image_miss(data=datas[1]) -> None:
            key = media_key(None, "image", data, fp)
            pipe.cache.get(key)
            pre.image(decode_image(data, pipe.limits, "bench"), None)

        hit_bytes = paths[0].read_bytes()

        def image_hit(data=hit_bytes) -> None:
            assert pipe.cache.get(media_key(None, "image", data, fp)) is not None

        image_miss_t, image_hit_t = interleaved(
            [image_miss, image_hit], Budget(1, num_misses, num_misses * 2, 5.0)
        )
        image_hit_t += measure(image_hit, Budget(2, 20, 400 if quick else 2000, 1.0))
        say(f"  per image, bytes in hand: miss {spread(image_miss_t)}")
        say(f"  per image, bytes in hand: hit  {spread(image_hit_t)}")
        ratio = median(miss_t) / median(hit_all)
        ratio_off = median(off_t) / median(hit_all)
        return [
            Result(
                "processor_cache.per_image",
                f"processor work per {SIZE}x{SIZE} PNG (bytes in hand), miss / hit",
                median(image_miss_t) / median(image_hit_t),
                GOAL,
                details={"miss_s": median(image_miss_t), "hit_s": median(image_hit_t)},
            ),
            Result(
                "processor_cache.per_request",
                f"Pipeline.prepare of a request with one {SIZE}x{SIZE} PNG (file://), miss / hit",
                ratio,
                GOAL,
                details={
                    "miss_s": median(miss_t),
                    "hit_s": median(hit_all),
                    "miss_cache_off_s": median(off_t),
                    "miss_cache_off_over_hit": ratio_off,
                    **{f"miss_{k}_s": v for k, v in costs.items()},
                },
            ),
        ]
    finally:
        for p in pipelines:
            p.close()
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main(run, __doc__)
