"""The processor tier: identity of media, a bounded LRU of layouts + pixels, single flight."""

from __future__ import annotations

import asyncio
import gc
import io
import json
import os
from pathlib import Path

import pytest
from PIL import Image

from mmcache.processor.media_cache import MediaCache
from mmcache.processor.media_source import SETTLED_SECONDS, MediaSource
from mmcache.processor.pipeline import Pipeline
from mmcache.processor.preprocess import Preprocessor
from mmcache.processor.prompt import PromptBuilder
from mmcache.processor.request import parse_chat_request
from mmcache.shared.checkpoint import ModelSpec
from mmcache.shared.config import ProcessorConfig
from mmcache.shared.keys import media_key
from tests.media import image_bytes


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def pipeline(model: Path, media_dir: Path, cache_bytes: int) -> Pipeline:
    cfg = ProcessorConfig(
        model=str(model), allowed_local_media_path=str(media_dir), processor_cache_gb=cache_bytes / (1 << 30)
    )
    source = MediaSource(cfg.allowed_dirs, cfg.max_media_bytes, None)
    pre = Preprocessor(cfg.model, cfg.video_fps, cfg.max_video_frames)
    return Pipeline(cfg, source, pre, PromptBuilder(ModelSpec.load(model)))


def request(path: Path, salt: str | None = None) -> dict:
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"file://{path}"}}]}
        ],
    }
    if salt:
        body["cache_salt"] = salt
    return body


async def test_second_request_does_no_decode(tiny_model, tmp_path):
    path = tmp_path / "a.png"
    path.write_bytes(image_bytes(448, 448, seed=1))
    pipe = pipeline(tiny_model, tmp_path, 64 << 20)
    first = await pipe.prepare(parse_chat_request(request(path)))
    second = await pipe.prepare(parse_chat_request(request(path)))
    assert pipe.cache.stats.decodes == 1
    assert (first.report.processor_misses, second.report.processor_hits) == (1, 1)
    assert first.token_ids == second.token_ids
    assert [c.key for c in first.media[0].chunks] == [c.key for c in second.media[0].chunks]


async def test_salts_do_not_share_entries(tiny_model, tmp_path):
    path = tmp_path / "a.png"
    path.write_bytes(image_bytes(200, 200, seed=2))
    pipe = pipeline(tiny_model, tmp_path, 64 << 20)
    a = await pipe.prepare(parse_chat_request(request(path, "a")))
    b = await pipe.prepare(parse_chat_request(request(path, "b")))
    assert pipe.cache.stats.decodes == 2 and b.report.processor_misses == 1
    assert a.media[0].chunks[0].key != b.media[0].chunks[0].key  # chunk keys are salted too


async def test_concurrent_misses_decode_once(tiny_model, tmp_path):
    path = tmp_path / "a.png"
    path.write_bytes(image_bytes(448, 448, seed=3))
    pipe = pipeline(tiny_model, tmp_path, 64 << 20)
    outs = await asyncio.gather(*(pipe.prepare(parse_chat_request(request(path))) for _ in range(6)))
    assert pipe.cache.stats.decodes == 1
    assert sum(o.report.processor_hits for o in outs) == 5


async def test_a_failed_decode_is_not_cached(tiny_model, tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10)
    pipe = pipeline(tiny_model, tmp_path, 64 << 20)
    for _ in range(2):
        with pytest.raises(Exception, match="cannot decode image"):
            await pipe.prepare(parse_chat_request(request(bad)))
    assert pipe.cache.stats.decodes == 2 and len(pipe.cache) == 0


async def test_repeated_data_url_skips_even_base64_decoding(tiny_model, tmp_path):
    from tests.media import data_url

    pipe = pipeline(tiny_model, tmp_path, 64 << 20)
    fetched = []
    real_fetch = pipe.source.fetch

    async def counting_fetch(url, where):
        fetched.append(url)
        return await real_fetch(url, where)

    pipe.source.fetch = counting_fetch
    url = data_url(image_bytes(300, 200, seed=5), "image/png")
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
    }
    first = await pipe.prepare(parse_chat_request(body))
    second = await pipe.prepare(parse_chat_request(body))
    assert len(fetched) == 1 and second.report.processor_hits == 1
    assert second.media[0] is first.media[0]
    # The same bytes under another salt are another entry, found by its own alias.
    salted = await pipe.prepare(parse_chat_request({**body, "cache_salt": "s"}))
    assert salted.report.processor_misses == 1 and len(fetched) == 2
    # If the entry is evicted, the alias still leads back to the bytes: decoded again, same layout.
    pipe.cache._entries.clear()
    third = await pipe.prepare(parse_chat_request(body))
    assert third.report.processor_misses == 1 and len(fetched) == 3
    assert [c.key for c in third.media[0].chunks] == [c.key for c in first.media[0].chunks]


def test_every_processor_setting_changes_the_fingerprint(tiny_model, tmp_path):
    base = Preprocessor(str(tiny_model), 2.0, 64).fingerprint
    assert Preprocessor(str(tiny_model), 1.0, 64).fingerprint != base
    assert Preprocessor(str(tiny_model), 2.0, 32).fingerprint != base
    for section, field, value in [
        ("image_processor", "size", {"longest_edge": 100352, "shortest_edge": 3136}),
        ("image_processor", "image_mean", [0.5, 0.5, 0.5]),
        ("video_processor", "size", {"longest_edge": 50176, "shortest_edge": 6272}),
        ("video_processor", "image_std", [0.5, 0.5, 0.5]),
    ]:
        other = tmp_path / f"{section}-{field}"
        other.mkdir()
        for f in tiny_model.iterdir():
            (other / f.name).symlink_to(f)
        (other / "processor_config.json").unlink()
        config = json.loads((tiny_model / "processor_config.json").read_text())
        config[section][field] = value
        (other / "processor_config.json").write_text(json.dumps(config))
        changed = Preprocessor(str(other), 2.0, 64).fingerprint
        assert changed != base, (section, field)
        data = image_bytes(64, 64)
        assert media_key(None, "image", data, changed) != media_key(None, "image", data, base)


def test_lru_is_bounded_in_bytes(tiny_model):
    pre = Preprocessor(str(tiny_model), 2.0, 64)
    layouts = [pre.image(Image.open(io.BytesIO(image_bytes(112, 112, seed=i))), None) for i in range(6)]
    size = layouts[0].nbytes
    cache = MediaCache(capacity_bytes=3 * size + 3 * 2 * 512)
    for i, layout in enumerate(layouts):
        cache.put(bytes([i]) * 16, layout)
        assert cache.nbytes <= cache.capacity
    assert len(cache) == 3
    assert cache.get(bytes([0]) * 16) is None and cache.get(bytes([5]) * 16) is not None
    assert cache.stats.evictions == 3


def test_entries_a_live_request_holds_are_not_evicted_and_stay_in_the_budget(tiny_model):
    pre = Preprocessor(str(tiny_model), 2.0, 64)
    layouts = [pre.image(Image.open(io.BytesIO(image_bytes(112, 112, seed=i))), None) for i in range(4)]
    cache = MediaCache(capacity_bytes=2 * layouts[0].nbytes + 2 * 2 * 512)
    key = [bytes([i]) * 16 for i in range(4)]
    cache.put(key[0], layouts[0])
    cache.put(key[1], layouts[1])
    assert cache.pin(key[0]) and cache.pin(key[0]) and not cache.pin(key[3])
    cache.put(key[2], layouts[2])  # evicts 1, the oldest entry nobody pins
    assert cache.get(key[1]) is None and cache.get(key[0]) is not None
    cache.pin(key[2])
    cache.put(key[3], layouts[3])  # everything held: not kept, nothing evicted
    assert cache.get(key[3]) is None and len(cache) == 2 and cache.nbytes <= cache.capacity
    cache.unpin(key[0])
    cache.put(key[3], layouts[3])
    assert cache.get(key[0]) is not None  # still held once
    cache.unpin(key[0])
    cache.unpin(key[2])
    cache.put(key[1], layouts[1])
    assert len(cache) == 2 and cache.stats.evictions == 2


async def test_500_distinct_images_through_a_small_cap_keep_memory_flat(tiny_model, tmp_path):
    cap = 4 << 20
    pipe = pipeline(tiny_model, tmp_path, cap)
    paths = []
    for i in range(500):
        path = tmp_path / f"{i}.png"
        path.write_bytes(image_bytes(256, 256, seed=1000 + i))
        paths.append(path)
    peak_bytes = 0
    rss = []
    for i, path in enumerate(paths):
        pipe.done(await pipe.prepare(parse_chat_request(request(path))))
        peak_bytes = max(peak_bytes, pipe.cache.nbytes)
        assert pipe.cache.nbytes <= cap
        if i in (99, 499):
            gc.collect()
            rss.append(rss_bytes())
    assert pipe.cache.stats.decodes == 500
    assert pipe.cache.stats.evictions > 400
    assert peak_bytes > cap // 2  # the cap was actually exercised
    # After warm-up, 400 more distinct images may not grow the process by more than the cap.
    assert rss[1] - rss[0] < 2 * cap, rss


async def test_a_settled_file_is_not_read_again_until_it_changes(tiny_model, tmp_path):
    """A repeat of a file whose status settled costs a stat, not a read; rewriting it in place
    (same size, its mtime put back) moves its ctime, so the next request reads the new bytes."""
    path = tmp_path / "a.bmp"  # uncompressed: another picture of the same size has the same length
    path.write_bytes(image_bytes(448, 448, seed=5, fmt="BMP"))
    await asyncio.sleep(SETTLED_SECONDS + 0.1)
    pipe = pipeline(tiny_model, tmp_path, 64 << 20)
    first = await pipe.prepare(parse_chat_request(request(path)))
    second = await pipe.prepare(parse_chat_request(request(path)))
    assert pipe.source.file_reads == 1 and second.report.processor_hits == 1
    assert first.media[0].chunks[0].key == second.media[0].chunks[0].key

    old = path.stat()
    replacement = image_bytes(448, 448, seed=6, fmt="BMP")
    assert len(replacement) == old.st_size
    path.write_bytes(replacement)
    os.utime(path, ns=(old.st_atime_ns, old.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (old.st_size, old.st_mtime_ns)
    third = await pipe.prepare(parse_chat_request(request(path)))
    assert pipe.source.file_reads == 2 and third.report.processor_misses == 1
    assert third.media[0].chunks[0].key != first.media[0].chunks[0].key


async def test_a_file_that_just_changed_is_read_every_time(tiny_model, tmp_path):
    """Within a timestamp tick a second write could leave the status as it was: until the
    file has settled, every request reads it (and hits the cache by its bytes)."""
    path = tmp_path / "a.png"
    path.write_bytes(image_bytes(200, 200, seed=7))
    pipe = pipeline(tiny_model, tmp_path, 64 << 20)
    await pipe.prepare(parse_chat_request(request(path)))
    second = await pipe.prepare(parse_chat_request(request(path)))
    assert pipe.source.file_reads == 2 and second.report.processor_hits == 1
