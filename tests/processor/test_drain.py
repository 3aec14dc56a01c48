"""The processor's drain on shutdown: a request that finishes within the grace period completes, one
that would outlast it is cancelled, and the server's stop does not wait for it."""

from __future__ import annotations

import asyncio
import time

from aiohttp import ClientSession, web

from mmcache.processor.drain import Drain


async def _serve(drain: Drain, handlers: dict) -> tuple[web.AppRunner, str]:
    app = web.Application(middlewares=[drain.middleware])
    app.on_shutdown.append(drain.on_shutdown)
    for path, handler in handlers.items():
        app.router.add_get(path, handler)
    runner = web.AppRunner(app, shutdown_timeout=30)  # aiohttp alone would wait this long
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def test_a_request_within_the_grace_completes_and_a_longer_one_is_cancelled() -> None:
    ended: dict[str, str] = {}

    async def short(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(0.3)
        ended["short"] = "done"
        return web.Response(text="ok")

    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        try:
            while True:
                await resp.write(b"data: x\n\n")
                await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            ended["endless"] = "cancelled"
            raise

    drain = Drain(grace=1.0)
    runner, url = await _serve(drain, {"/short": short, "/endless": endless})
    async with ClientSession() as session:
        stream = await session.get(url + "/endless")
        assert stream.status == 200
        short_reply = asyncio.ensure_future(session.get(url + "/short"))
        while len(drain.tasks) < 2:
            await asyncio.sleep(0.01)
        start = time.monotonic()
        await runner.cleanup()
        took = time.monotonic() - start
        assert (await short_reply).status == 200
        stream.close()
    assert ended == {"short": "done", "endless": "cancelled"}
    assert drain.tasks == set()
    assert 1.0 <= took < 5.0, took


async def test_no_request_in_flight_stops_at_once() -> None:
    drain = Drain(grace=10.0)

    async def hello(request: web.Request) -> web.StreamResponse:
        return web.Response(text="hi")

    runner, url = await _serve(drain, {"/": hello})
    async with ClientSession() as session, session.get(url + "/") as resp:
        assert await resp.text() == "hi"
    start = time.monotonic()
    await runner.cleanup()
    assert time.monotonic() - start < 2.0
