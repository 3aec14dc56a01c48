"""http(s) media fetching with an SSRF guard, a byte cap, a redirect cap and timeouts.

Every address a request connects to is checked *after* DNS resolution, on every
redirect hop: the guarded resolver hands the connector only addresses that
passed, so a name cannot resolve to a public address for the check and to a
private one for the connection. Loopback, private, link-local, multicast,
reserved and unspecified addresses are refused unless an allowed network
(``--allowed-media-networks``) contains them.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from urllib.parse import urljoin, urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

from mmcache.processor.errors import bad_request

_Net = ipaddress.IPv4Network | ipaddress.IPv6Network
_Addr = ipaddress.IPv4Address | ipaddress.IPv6Address


class BlockedAddress(OSError):
    """A media host resolved to an address the guard refuses."""


def parse_networks(spec: list[str]) -> list[_Net]:
    try:
        return [ipaddress.ip_network(s, strict=False) for s in spec]
    except ValueError as exc:
        raise ValueError(f"--allowed-media-networks: {exc}") from exc


def is_refused(addr: _Addr, allowed: list[_Net]) -> bool:
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if any(addr in net for net in allowed):
        return False
    return (
        addr.is_loopback
        or addr.is_private
        or addr.is_link_local
        or addr.is_multicast
        or addr.is_reserved
        or addr.is_unspecified
        or not addr.is_global
    )


class GuardedResolver(AbstractResolver):
    def __init__(self, allowed: list[_Net]):
        self._allowed = allowed

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET) -> list[ResolveResult]:
        infos = await asyncio.get_running_loop().getaddrinfo(
            host, port, type=socket.SOCK_STREAM, family=family
        )
        out: list[ResolveResult] = []
        for fam, _, proto, _, sockaddr in infos:
            addr = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
            if is_refused(addr, self._allowed):
                raise BlockedAddress(f"{host} resolves to {addr}, which is not a public address")
            out.append(
                ResolveResult(
                    hostname=host,
                    host=str(addr),
                    port=int(sockaddr[1]),
                    family=fam,
                    proto=proto,
                    flags=socket.AI_NUMERICHOST,
                )
            )
        if not out:
            raise OSError(f"{host} does not resolve")
        return out

    async def close(self) -> None:
        return None


class HttpFetcher:
    def __init__(self, allowed: list[_Net], max_bytes: int, timeout: float, max_redirects: int):
        self._allowed = allowed
        self._max_bytes = max_bytes
        self._timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=min(timeout, 5.0))
        self._max_redirects = max_redirects
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(
                resolver=GuardedResolver(self._allowed), limit=64, ttl_dns_cache=0
            )
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        return self._session

    async def fetch(self, url: str, where: str) -> bytes:
        try:
            async with asyncio.timeout(self._timeout.total):
                return await self._fetch(url, where)
        except TimeoutError as exc:
            raise bad_request(f"{where}: fetching {url} timed out", "media_fetch_timeout", where) from exc

    async def _fetch(self, url: str, where: str) -> bytes:
        for _ in range(self._max_redirects + 1):
            self._check_literal_host(url, where)
            try:
                async with self._client().get(url, allow_redirects=False) as resp:
                    if resp.status in (301, 302, 303, 307, 308) and "Location" in resp.headers:
                        url = urljoin(url, resp.headers["Location"])
                        continue
                    if resp.status != 200:
                        raise bad_request(
                            f"{where}: fetching {url} returned HTTP {resp.status}",
                            "media_fetch_failed",
                            where,
                        )
                    return await self._read_capped(resp, where)
            except aiohttp.ClientConnectorError as exc:
                if isinstance(exc.os_error, BlockedAddress):
                    raise bad_request(f"{where}: {exc.os_error}", "media_url_blocked", where) from exc
                raise bad_request(
                    f"{where}: cannot connect to fetch {url}", "media_fetch_failed", where
                ) from exc
            except aiohttp.ClientError as exc:
                raise bad_request(
                    f"{where}: fetching {url} failed: {exc}", "media_fetch_failed", where
                ) from exc
        raise bad_request(
            f"{where}: more than {self._max_redirects} redirects", "media_too_many_redirects", where
        )

    def _check_literal_host(self, url: str, where: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise bad_request(f"{where}: unsupported media URL {url!r}", "media_url_scheme", where)
        try:
            addr = ipaddress.ip_address(parts.hostname)
        except ValueError:
            return  # a name: the resolver checks every address it resolves to
        if is_refused(addr, self._allowed):
            raise bad_request(f"{where}: {addr} is not a public address", "media_url_blocked", where)

    async def _read_capped(self, resp: aiohttp.ClientResponse, where: str) -> bytes:
        if resp.content_length is not None and resp.content_length > self._max_bytes:
            raise bad_request(
                f"{where}: media is larger than {self._max_bytes} bytes", "media_too_large", where
            )
        data = bytearray()
        async for block in resp.content.iter_chunked(1 << 16):
            data += block
            if len(data) > self._max_bytes:
                raise bad_request(
                    f"{where}: media is larger than {self._max_bytes} bytes", "media_too_large", where
                )
        return bytes(data)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
