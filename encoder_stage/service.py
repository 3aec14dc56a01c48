"""The encoder stage process: lookup, encode (cached, single flight, batched) and fetch over ZeroMQ."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import torch
import zmq

from mmcache.encoder_stage.batcher import Batcher
from mmcache.encoder_stage.embedding_cache import EmbeddingCache
from mmcache.encoder_stage.metrics import EncoderMetrics
from mmcache.encoder_stage.vision import VisionInput, VisionTower
from mmcache.shared.checkpoint import ModelSpec
from mmcache.shared.config import EncoderConfig
from mmcache.shared.keys import ChunkKey, embed_key
from mmcache.shared.messages import (
    Abort,
    EncodeItem,
    EncodeReply,
    EncodeRequest,
    ErrorReply,
    FetchReply,
    FetchRequest,
    LookupReply,
    LookupRequest,
    Ping,
    Pong,
    ReleaseHandoff,
)
from mmcache.shared.metrics import MetricsServer
from mmcache.shared.rpc import Responder
from mmcache.shared.service import replica_id, run_stage, with_metrics_server
from mmcache.shared.single_flight import SingleFlight

log = logging.getLogger(__name__)


def default_batch_tokens(device: torch.device) -> int:
    """Patches per vision forward when not set. A GPU amortizes each forward over its batch; a
    CPU computes a batch in the time of its chunks one by one, and every chunk waits for the whole
    batch, so there batches stay at two 448x448 images (README: the figures behind the choice)."""
    return 4096 if device.type == "cuda" else 2048


class EncoderService:
    def __init__(self, cfg: EncoderConfig, tower: VisionTower):
        self.cfg = cfg
        self.tower = tower
        self.metrics = EncoderMetrics(self.stats)
        self.batcher = Batcher(
            tower, cfg.max_batch_tokens or default_batch_tokens(tower.device), self.metrics.forward
        )
        self.cache = EmbeddingCache(cfg.cache_bytes, cfg.handoff_ttl)
        self._flight: SingleFlight[bytes, torch.Tensor] = SingleFlight()
        self.num_fetches = 0
        self.metrics_server: MetricsServer | None = None

    def key(self, chunk: bytes) -> bytes:
        return embed_key(ChunkKey(chunk), self.tower.fingerprint)

    def quick(self, msg: Any, reply: Responder) -> bool:
        """Everything but encoding is answered as it arrives, without a task."""
        if isinstance(msg, FetchRequest):
            self._fetch(msg, reply)
        elif isinstance(msg, LookupRequest):
            missing = [k for k in msg.keys if not self._lookup(self.key(k), msg.handoff)]
            reply.send_nowait(LookupReply(missing))
        elif isinstance(msg, ReleaseHandoff):
            for k in msg.keys:
                self.cache.release(self.key(k))
        elif isinstance(msg, Ping):
            reply.send_nowait(self.pong())
        elif isinstance(msg, Abort):
            pass  # an abandoned call: the work is shared, let it finish
        else:
            return False  # encoding (and anything unknown) goes to :meth:`handle`
        return True

    async def handle(self, msg: Any, reply: Responder) -> None:
        if isinstance(msg, EncodeRequest):
            await self._encode(msg, reply)
        else:
            await reply.send(ErrorReply("bad_message", f"encoder does not handle {type(msg).__name__}", 400))

    def stats(self) -> dict[str, int]:
        """This replica's numbers (read by the metrics thread: ints and lengths only)."""
        batches, cache = self.batcher.stats, self.cache
        return {
            "forwards": batches.forwards,
            "chunks_encoded": batches.chunks,
            "patches": batches.patches,
            "cache_hits": cache.stats.hits,
            "cache_misses": cache.stats.misses,
            "cache_evictions": cache.stats.evictions,
            "cache_entries": len(cache),
            "cache_bytes": cache.nbytes,
            "cache_capacity_bytes": cache.capacity,
            "fetches": self.num_fetches,
            "queued": self.batcher.queued,
        }

    def pong(self) -> Pong:
        info = self.stats()
        if self.metrics_server is not None and self.metrics_server.port is not None:
            info["metrics_port"] = self.metrics_server.port
        return Pong(
            "encoder",
            self.tower.spec.name,
            self.tower.fingerprint,
            self.batcher.queued,
            info,
            id=replica_id(),
        )

    def _lookup(self, key: bytes, handoff: bool) -> bool:
        """Present? (then pinned for hand-off if asked). A key still being computed counts as
        missing: the encode that follows joins that forward and takes its own pin."""
        return self.cache.lookup(key) and self.cache.touch(key, handoff)

    async def _encode(self, msg: EncodeRequest, reply: Responder) -> None:
        if self.batcher.queued + len(msg.items) > self.cfg.max_queue:
            await reply.send(ErrorReply("overloaded", "encoder queue is full, retry later", 503))
            return
        for item in msg.items:
            if problem := self.check(item):
                await reply.send(ErrorReply("bad_pixels", problem, 400))
                return
        await asyncio.gather(*(self._encode_one(item, msg.handoff) for item in msg.items))
        await reply.send(EncodeReply())

    async def _encode_one(self, item: EncodeItem, handoff: bool) -> None:
        """Make sure ``item`` is cached (pinned for hand-off if asked)."""
        key = self.key(item.key)
        if self.cache.touch(key, handoff):
            return
        # NOTE: concurrent requests for one key share one forward
        rows, _ = await self._flight.run(key, lambda: self._compute(key, item))
        if not self.cache.touch(key, handoff):
            self.cache.put(key, rows, handoff)

    async def _compute(self, key: bytes, item: EncodeItem) -> torch.Tensor:
        rows = await self.batcher.encode(VisionInput(item.modality, item.pixels))
        self.cache.put(key, rows, handoff=False)
        return rows

    def _fetch(self, msg: FetchRequest, reply: Responder) -> None:
        key = self.key(msg.key)
        rows = self.cache.read(key)
        if rows is None:
            reply.send_nowait(ErrorReply("embedding_missing", msg.key.hex(), 404))
            return
        try:
            if not 0 <= msg.start < msg.end <= rows.shape[0]:
                reply.send_nowait(
                    ErrorReply("bad_rows", f"rows [{msg.start}, {msg.end}) of {rows.shape[0]}", 400)
                )
                return
            self.num_fetches += 1
            reply.send_nowait(FetchReply(rows[msg.start : msg.end]))
        finally:
            self.cache.done(key, release_handoff=msg.release)

    def check(self, item: EncodeItem) -> str | None:
        """Reject pixels the tower cannot take, before they can fail a shared batch."""
        px = item.pixels
        factor = self.tower.image_processor.patch_size * self.tower.merge
        frames = 1 if item.modality == "image" else self.tower.video_processor.temporal_patch_size
        if item.modality not in ("image", "video"):
            return f"unknown modality {item.modality!r}"
        if px.dtype != torch.uint8 or px.ndim != 4 or px.shape[0] != frames or px.shape[1] != 3:
            return (
                f"{item.modality} pixels must be uint8 ({frames}, 3, H, W), got {px.dtype} {tuple(px.shape)}"
            )
        if px.shape[2] % factor or px.shape[3] % factor or px.shape[2] == 0 or px.shape[3] == 0:
            return f"pixel height and width must be positive multiples of {factor}, got {tuple(px.shape[2:])}"
        return None

    def close(self) -> None:
        self.batcher.close()


def run(cfg: EncoderConfig) -> None:
    spec = ModelSpec.load(cfg.model)

    async def make(ctx: zmq.Context):
        service = EncoderService(cfg, VisionTower(spec, cfg.device, cfg.dtype))
        return await with_metrics_server(service, cfg.metrics_port)

    run_stage("encoder", cfg.bind, cfg.torch_threads, make, cfg.log_format)
