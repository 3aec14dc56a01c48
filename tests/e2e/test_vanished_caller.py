"""An LLM stage whose caller disappears mid-stream stops generating for it (ROUTER_MANDATORY
turns the next reply into EHOSTUNREACH, and the stream cancels its sequence)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import pytest
import torch
import zmq.asyncio

from mmcache.shared.messages import GenerateRequest, Ping, SamplingParams
from mmcache.shared.rpc import RpcClient
from tests.e2e.server import free_port, stage_env

pytestmark = pytest.mark.e2e


async def _pong(ctx, address: str, timeout: float = 60.0):
    client = RpcClient(ctx, address, "probe")
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return await client.call(Ping(), timeout=2.0)
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise
    finally:
        client.close()


async def test_generation_stops_when_the_caller_is_gone(tiny_model):
    address = f"tcp://127.0.0.1:{free_port()}"
    env = stage_env()
    cmd = [sys.executable, "-m", "mmcache", "llm", "--model", str(tiny_model), "--bind", address]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ctx = zmq.asyncio.Context()
    try:
        await _pong(ctx, address)
        caller = RpcClient(ctx, address, "caller")
        request = GenerateRequest(
            prompt_token_ids=torch.arange(1, 40, dtype=torch.int32),
            spans=[],
            sources=[],
            handoff=[],
            sampling=SamplingParams(max_tokens=20_000, temperature=0.0, ignore_eos=True),
        )
        stream = caller.stream(request, timeout=30)
        await stream.__aenter__()
        first = await anext(aiter(stream))
        assert first.token_ids  # it is generating
        # Vanish without an Abort: the connection just drops. NOTE: through close(), which takes
        # the socket's descriptor off the event loop first; a bare zmq close left it registered,
        # and probes' new sockets reusing its number could go unwatched (a ~20 s stall seen once).
        caller.close()
        await asyncio.sleep(0.5)
        steps = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            pong = await _pong(ctx, address)
            steps.append(pong.info["steps"])
            if pong.load == 0 and len(steps) >= 2 and steps[-1] == steps[-2]:
                break
            await asyncio.sleep(0.3)
        assert pong.load == 0 and steps[-1] == steps[-2], steps  # no sequence left, no more steps
        assert steps[-1] < 5000  # it stopped long before max_tokens
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
        ctx.destroy(linger=0)
