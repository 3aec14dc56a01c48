"""The encoder stage process: answers encode requests over ZeroMQ."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import torch
import zmq.asyncio

from encoder_stage.batcher import Batcher
from encoder_stage.vision import Chunk, VisionTower
from shared.checkpoint import ModelSpec
from shared.config import EncoderConfig
from shared.messages import EncodeItem, EncodeReply, EncodeRequest, ErrorReply, Ping, Pong
from shared.rpc import Responder
from shared.service import serve, setup_logging

log = logging.getLogger(__name__)


class EncoderService:
    def __init__(self, cfg: EncoderConfig, tower: VisionTower):
        self.cfg = cfg
        self.tower = tower
        self.batcher = Batcher(tower, cfg.max_batch_tokens)

    async def handle(self, msg: Any, reply: Responder) -> None:
        if isinstance(msg, EncodeRequest):
            await self._encode(msg, reply)
        elif isinstance(msg, Ping):
            await reply.send(self.pong())
        else:
            await reply.send(ErrorReply("bad_message", f"encoder does not handle {type(msg).__name__}", 400))

    def pong(self) -> Pong:
        stats = self.batcher.stats
        return Pong(
            stage="encoder",
            model=self.tower.spec.name,
            fingerprint=self.tower.fingerprint,
            load=self.batcher.queued,
            info={"forwards": stats.forwards, "chunks_encoded": stats.chunks, "patches": stats.patches},
        )

    async def _encode(self, msg: EncodeRequest, reply: Responder) -> None:
        for item in msg.items:
            if problem := self.check(item):
                await reply.send(ErrorReply("bad_pixels", problem, 400))
                return
        chunks = [Chunk(item.modality, item.pixels) for item in msg.items]
        embeddings = await asyncio.gather(*(self.batcher.encode(c) for c in chunks))
        await reply.send(EncodeReply(list(embeddings)))

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
    setup_logging("encoder")
    spec = ModelSpec.load(cfg.model)

    async def make(ctx: zmq.asyncio.Context):
        tower = VisionTower(spec, cfg.device, cfg.dtype)
        service = EncoderService(cfg, tower)
        return service.handle, service.close

    asyncio.run(serve("encoder", cfg.bind, make))
