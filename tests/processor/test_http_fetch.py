"""http(s) media: SSRF guard (after DNS, on every redirect), byte cap, redirect cap, timeout.

A local aiohttp server plays the media host; tests that need it reachable allow-list its network.
"""

from __future__ import annotations

import asyncio
import ipaddress

import pytest
from aiohttp import web

from mmcache.processor.errors import APIError
from mmcache.processor.http_fetch import HttpFetcher, is_refused, parse_networks

PAYLOAD = b"\x89PNG" + b"x" * 5000


@pytest.fixture
async def media_host(aiohttp_server):
    async def image(request):
        return web.Response(body=PAYLOAD, content_type="image/png")

    async def redirect(request):
        raise web.HTTPFound(request.query["to"])

    async def loop(request):
        raise web.HTTPFound("/loop")

    async def big(request):
        return web.Response(body=b"y" * 200_000)

    async def chunked(request):
        resp = web.StreamResponse()
        await resp.prepare(request)
        for _ in range(50):
            await resp.write(b"z" * 10_000)
        return resp

    async def slow(request):
        await asyncio.sleep(5)
        return web.Response(body=b"late")

    async def missing(request):
        return web.Response(status=404)

    app = web.Application()
    app.router.add_get("/image.png", image)
    app.router.add_get("/redirect", redirect)
    app.router.add_get("/loop", loop)
    app.router.add_get("/big", big)
    app.router.add_get("/chunked", chunked)
    app.router.add_get("/slow", slow)
    app.router.add_get("/missing", missing)
    return await aiohttp_server(app, host="127.0.0.1")


def fetcher(
    allowed: list[str], max_bytes: int = 100_000, timeout: float = 2.0, redirects: int = 3
) -> HttpFetcher:
    return HttpFetcher(parse_networks(allowed), max_bytes, timeout, redirects)


async def refused(f: HttpFetcher, url: str) -> APIError:
    with pytest.raises(APIError) as info:
        await f.fetch(url, "messages[0].content[0]")
    assert info.value.status == 400
    return info.value


async def test_allow_listed_host_is_fetched(media_host):
    f = fetcher(["127.0.0.1/32"])
    try:
        assert await f.fetch(f"http://127.0.0.1:{media_host.port}/image.png", "x") == PAYLOAD
    finally:
        await f.close()


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]", "127.1.2.3"])
async def test_loopback_is_refused_by_default(media_host, host):
    f = fetcher([])
    try:
        err = await refused(f, f"http://{host}:{media_host.port}/image.png")
        assert err.code == "media_url_blocked"
        assert "public" in err.message
    finally:
        await f.close()


async def test_redirect_from_allowed_host_to_loopback_is_refused(media_host):
    f = fetcher(["127.0.0.1/32"])  # the media host itself is allowed, ::1 and 127.0.0.2 are not
    try:
        for target in (f"http://127.0.0.2:{media_host.port}/image.png", f"http://[::1]:{media_host.port}/x"):
            err = await refused(f, f"http://127.0.0.1:{media_host.port}/redirect?to={target}")
            assert err.code == "media_url_blocked"
    finally:
        await f.close()


async def test_redirect_within_allowed_host_is_followed(media_host):
    f = fetcher(["127.0.0.1/32"])
    try:
        url = f"http://127.0.0.1:{media_host.port}/redirect?to=/image.png"
        assert await f.fetch(url, "x") == PAYLOAD
    finally:
        await f.close()


async def test_redirect_cap(media_host):
    f = fetcher(["127.0.0.1/32"], redirects=2)
    try:
        err = await refused(f, f"http://127.0.0.1:{media_host.port}/loop")
        assert err.code == "media_too_many_redirects"
    finally:
        await f.close()


@pytest.mark.parametrize("path", ["/big", "/chunked"])
async def test_byte_cap(media_host, path):
    f = fetcher(["127.0.0.1/32"], max_bytes=100_000)
    try:
        err = await refused(f, f"http://127.0.0.1:{media_host.port}{path}")
        assert err.code == "media_too_large"
    finally:
        await f.close()


async def test_timeout(media_host):
    f = fetcher(["127.0.0.1/32"], timeout=0.5)
    try:
        err = await refused(f, f"http://127.0.0.1:{media_host.port}/slow")
        assert err.code == "media_fetch_timeout"
    finally:
        await f.close()


async def test_http_error_status_is_a_400_naming_it(media_host):
    f = fetcher(["127.0.0.1/32"])
    try:
        err = await refused(f, f"http://127.0.0.1:{media_host.port}/missing")
        assert "404" in err.message
    finally:
        await f.close()


@pytest.mark.parametrize(
    "addr",
    [
        "10.0.0.1",
        "172.16.5.4",
        "192.168.1.1",
        "169.254.169.254",
        "224.0.0.1",
        "0.0.0.0",
        "::ffff:127.0.0.1",
        "fe80::1",
        "fc00::1",
        "100.64.0.1",
    ],
)
def test_non_public_addresses_are_refused(addr):
    assert is_refused(ipaddress.ip_address(addr), [])


def test_public_addresses_pass_and_allow_list_overrides():
    assert not is_refused(ipaddress.ip_address("93.184.216.34"), [])
    assert not is_refused(ipaddress.ip_address("10.1.2.3"), parse_networks(["10.0.0.0/8"]))
