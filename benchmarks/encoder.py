"""The encoder stage: cache hit vs miss, bytes on the wire per image token, embedding fetch throughput.

(a) Latency per 448x448 image through a real encoder process
    (``mmcache encoder --bind tcp://127.0.0.1:PORT``), spoken to with ``shared.rpc.RpcClient``:
    miss = EncodeRequest of a new image, then FetchRequest of its rows (releasing the hand-off);
    hit = LookupRequest of a cached image (pins it), then FetchRequest of its rows.
    The brief sets no goal for this ratio; 50x (the processor cache's) is used.
(b) Bytes sent processor -> encoder per image token: the uint8 pixel frames of our
    EncodeRequest vs the float32 ``pixel_values`` the HF processor makes for the same media,
    for a 1024x1024 PNG and an 8-frame video (goal <= 1/4). The figure is the pixel payload;
    the msgpack header and type frames are printed separately.
(c) Throughput of fetching one large embedding (FetchRequest -> FetchReply, a few MB of rows)
    over tcp loopback vs bare ZeroMQ DEALER/ROUTER frames of the same size over tcp loopback,
    answered by a plain-zmq server process (goal >= 0.7x).
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import torch
import zmq
import zmq.asyncio

from mmcache.benchmarks.common import (
    Budget,
    Result,
    StageProcess,
    ainterleaved,
    ameasure,
    fmt_time,
    free_port,
    main,
    median,
    model_dir,
    say,
    spread,
)
from mmcache.harness import STARTUP_TIMEOUT

BYTES_GOAL = 0.25
FETCH_GOAL = 0.7
IMAGE = 448  # (a): a real-ish image, 256 tokens
BIG = 1792  # (c): 4096 rows of embeddings
CALL_TIMEOUT = 60.0  # seconds; no request may hang the benchmark


async def _wait_pong(client, proc: StageProcess):
    from mmcache.shared.messages import Ping

    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        proc.check_running()
        try:
            return await client.call(Ping(), timeout=1.0)
        except TimeoutError:
            continue
    raise RuntimeError(f"the encoder did not answer:\n{proc.log_tail()}")


def _pixels(rng: np.random.Generator, size: int) -> torch.Tensor:
    return torch.from_numpy(rng.integers(0, 256, (1, 3, size, size), dtype=np.uint8))


async def hit_vs_miss(client, rng: np.random.Generator, quick: bool) -> tuple[Result, dict]:
    from mmcache.shared.messages import EncodeItem, EncodeRequest, FetchRequest, LookupRequest

    tokens = (IMAGE // 28) ** 2
    num_misses = 4 if quick else 16
    images = [_pixels(rng, IMAGE) for _ in range(num_misses + 2)]
    hit_key = rng.bytes(16)
    await client.call(
        EncodeRequest([EncodeItem(hit_key, "image", images[0])], handoff=False), timeout=CALL_TIMEOUT
    )
    fresh = iter(images[1:])

    async def miss() -> None:
        key = rng.bytes(16)
        await client.call(EncodeRequest([EncodeItem(key, "image", next(fresh))]), timeout=CALL_TIMEOUT)
        rows = (await client.call(FetchRequest(key, 0, tokens, release=True), timeout=CALL_TIMEOUT)).rows
        assert rows.shape[0] == tokens

    async def hit() -> None:
        reply = await client.call(LookupRequest([hit_key]), timeout=CALL_TIMEOUT)
        assert not reply.missing
        rows = (await client.call(FetchRequest(hit_key, 0, tokens, release=True), timeout=CALL_TIMEOUT)).rows
        assert rows.shape[0] == tokens

    miss_t, hit_t = await ainterleaved(
        [miss, hit], Budget(warmup=1, min_reps=num_misses, max_reps=num_misses, seconds=0)
    )
    hit_t += await ameasure(hit, Budget(5, 20, 200 if quick else 1000, 0.5 if quick else 2.0))
    say(f"  miss (encode {IMAGE}x{IMAGE} + fetch {tokens} rows): {spread(miss_t)}")
    say(f"  hit (lookup + fetch {tokens} rows): {spread(hit_t)}")
    ratio = median(miss_t) / median(hit_t)
    return Result(
        "encoder.hit_vs_miss",
        f"encoder latency per {IMAGE}x{IMAGE} image, miss / hit",
        ratio,
        None,
        details={"miss_s": median(miss_t), "hit_s": median(hit_t)},
    ), {"encoded": num_misses + 2}  # the hit image, the warm-up miss, the timed misses


def wire_bytes(quick: bool) -> list[Result]:
    from transformers import AutoProcessor

    from mmcache.media import image_bytes, video_bytes
    from mmcache.processor.media_decode import DecodeLimits, decode_image, decode_video
    from mmcache.processor.preprocess import Preprocessor
    from mmcache.shared.messages import EncodeItem, EncodeRequest
    from mmcache.shared.wire import encode

    model = model_dir()
    limits = DecodeLimits(40_000_000, 2.0, 64, 600.0)
    pre = Preprocessor(str(model), 2.0, 64)
    hf = AutoProcessor.from_pretrained(model)
    image = decode_image(image_bytes(1024, 1024, seed=0), limits, "bench")
    video = decode_video(video_bytes(8, 224, 224, fps=2, seed=1), limits, "bench")
    cases = {
        "1024x1024 PNG": (
            pre.image(image, None),
            hf.image_processor(images=[image], return_tensors="pt")["pixel_values"],
        ),
        "8-frame 224x224 video": (
            pre.video(video, None),
            hf.video_processor(videos=[list(video.frames)], do_sample_frames=False, return_tensors="pt")[
                "pixel_values_videos"
            ],
        ),
    }
    results = []
    for label, (layout, hf_pixels) in cases.items():
        msg = EncodeRequest([EncodeItem(c.key, layout.modality, c.pixels) for c in layout.chunks])
        frames = encode(msg, {"rid": 1})
        payload = sum(c.pixels.numel() * c.pixels.element_size() for c in layout.chunks)
        wire = sum(memoryview(f).nbytes for f in frames)
        tokens = layout.num_tokens
        hf_bytes = hf_pixels.numel() * hf_pixels.element_size()
        hf_tokens = hf_pixels.shape[0] // (layout.merge_size**2)
        assert hf_tokens == tokens, (hf_tokens, tokens)
        say(
            f"  {label}: {tokens} tokens; ours {payload / tokens:.0f} B/token of uint8 pixels "
            f"(+{(wire - payload) / tokens:.2f} B/token header: {wire - payload} B), "
            f"HF float32 pixel_values {hf_bytes / tokens:.0f} B/token {tuple(hf_pixels.shape)}; "
            f"with header {wire / hf_bytes:.5f}x"
        )
        results.append(
            Result(
                f"encoder.bytes_{layout.modality}",
                f"processor->encoder bytes per {layout.modality} token, uint8 pixels / HF float32 "
                f"pixel_values ({label})",
                payload / hf_bytes,
                BYTES_GOAL,
                higher_is_better=False,
                details={"ours_per_token": payload / tokens, "hf_per_token": hf_bytes / tokens},
            )
        )
    return results


async def fetch_throughput(ctx, client, rng, quick: bool) -> Result:
    from mmcache.shared.messages import EncodeItem, EncodeRequest, FetchRequest

    key = rng.bytes(16)
    rows_n = (BIG // 28) ** 2
    start = time.perf_counter()
    await client.call(
        EncodeRequest([EncodeItem(key, "image", _pixels(rng, BIG))], handoff=False), timeout=300
    )
    say(f"  encoded one {BIG}x{BIG} image ({rows_n} rows) in {time.perf_counter() - start:.1f} s")
    probe = (await client.call(FetchRequest(key, 0, rows_n), timeout=CALL_TIMEOUT)).rows
    nbytes = probe.numel() * probe.element_size()

    raw = StageProcess(
        [f"tcp://127.0.0.1:{free_port()}", str(nbytes)], module="mmcache.benchmarks._raw_zmq_server"
    )
    sync_ctx = zmq.Context()
    dealer = sync_ctx.socket(zmq.DEALER)
    adealer = ctx.socket(zmq.DEALER)
    try:
        address = await _raw_address(raw)
        for s in (dealer, adealer):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVTIMEO, 30_000)  # a stuck baseline raises zmq.Again, never hangs
            s.connect(address)

        def clients(rows: int, size: int):
            request = str(size).encode()

            async def ours() -> None:
                got = (await client.call(FetchRequest(key, 0, rows), timeout=CALL_TIMEOUT)).rows
                assert got.shape[0] == rows

            async def raw_sync() -> None:
                dealer.send(request)
                frames = dealer.recv_multipart(copy=False)
                assert len(frames[-1]) == size

            async def raw_async() -> None:
                await adealer.send(request)
                async with asyncio.timeout(30):
                    frames = await adealer.recv_multipart(copy=False)
                assert len(frames[-1]) == size

            return [ours, raw_sync, raw_async]

        budget = Budget(warmup=3, min_reps=10, max_reps=300 if quick else 2000, seconds=1.5 if quick else 6.0)
        ours_t, raw_t, araw_t = await ainterleaved(clients(rows_n, nbytes), budget)
        row_bytes = nbytes // rows_n
        small = Budget(warmup=3, min_reps=10, max_reps=300 if quick else 2000, seconds=0.5 if quick else 2.0)
        small_t = await ainterleaved(clients(1, row_bytes), small)
    finally:
        dealer.close(linger=0)
        adealer.close(linger=0)
        sync_ctx.term()
        raw.stop()
    gbs = {name: nbytes / median(t) / 1e9 for name, t in (("ours", ours_t), ("raw", raw_t), ("araw", araw_t))}
    say(f"  embedding of {rows_n} rows x {probe.shape[1]} {probe.dtype} = {nbytes / 1e6:.2f} MB")
    say(f"  mmcache FetchRequest -> FetchReply: {gbs['ours']:.2f} GB/s ({spread(ours_t)})")
    say(f"  raw zmq DEALER/ROUTER, sync client: {gbs['raw']:.2f} GB/s ({spread(raw_t)})")
    say(f"  raw zmq DEALER/ROUTER, asyncio client: {gbs['araw']:.2f} GB/s ({spread(araw_t)})")
    say(
        f"  one row ({row_bytes} B, the fixed cost per message): mmcache {fmt_time(median(small_t[0]))}, "
        f"raw sync {fmt_time(median(small_t[1]))}, raw asyncio {fmt_time(median(small_t[2]))}"
    )
    return Result(
        "encoder.fetch_throughput",
        f"embedding fetch GB/s ({nbytes / 1e6:.1f} MB over tcp loopback) / raw zmq DEALER/ROUTER GB/s",
        gbs["ours"] / gbs["raw"],
        FETCH_GOAL,
        details={
            "ours_gbs": gbs["ours"],
            "raw_gbs": gbs["raw"],
            "raw_async_gbs": gbs["araw"],
            "one_row_ours_s": median(small_t[0]),
            "one_row_raw_s": median(small_t[1]),
        },
    )


async def _raw_address(proc: StageProcess) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        proc.check_running()
        for line in proc.log_path.read_text().splitlines():
            if line.startswith("ready "):
                return line.split()[1]
        await asyncio.sleep(0.05)
    raise RuntimeError(f"the raw zmq server did not start:\n{proc.log_tail()}")


async def _served(quick: bool) -> list[Result]:
    from mmcache.shared.rpc import RpcClient

    model = model_dir()
    address = f"tcp://127.0.0.1:{free_port()}"
    rng = np.random.default_rng(7)
    ctx = zmq.asyncio.Context()
    proc = StageProcess(["encoder", "--model", str(model), "--bind", address])
    client = RpcClient(ctx, address, "bench")
    try:
        start = time.perf_counter()
        await _wait_pong(client, proc)
        say(f"  encoder up on {address} in {time.perf_counter() - start:.1f} s")
        say("# encoder (a): hit vs miss latency")
        latency, expect = await hit_vs_miss(client, rng, quick)
        pong = await _wait_pong(client, proc)
        assert pong.info["chunks_encoded"] == expect["encoded"], pong.info
        say("# encoder (c): embedding fetch throughput")
        fetch = await fetch_throughput(ctx, client, rng, quick)
        return [latency, fetch]
    finally:
        client.close()
        proc.stop()
        ctx.destroy(linger=0)


def run(quick: bool = False) -> list[Result]:
    results = asyncio.run(_served(quick))
    say("# encoder (b): bytes processor -> encoder per media token")
    return results[:1] + wire_bytes(quick) + results[1:]


if __name__ == "__main__":
    main(run, __doc__)
