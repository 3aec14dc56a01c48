"""Media bytes from a URL: ``data:`` (base64), ``file://`` under allowed directories, ``http(s)://``."""

from __future__ import annotations

import asyncio
import base64
import binascii
import os
from urllib.parse import unquote, urlsplit

from processor.errors import bad_request
from processor.http_fetch import HttpFetcher


class MediaSource:
    def __init__(self, allowed_dirs: list[str], max_bytes: int, http: HttpFetcher | None):
        self.allowed_dirs = allowed_dirs
        self.max_bytes = max_bytes
        self.http = http

    async def fetch(self, url: str, where: str) -> bytes:
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return self._data_url(url, where)
        if scheme == "file":
            return await asyncio.to_thread(self._file_url, url, where)
        if scheme in ("http", "https"):
            if self.http is None:
                raise bad_request(f"{where}: http(s) media URLs are disabled", "media_url_scheme", where)
            return await self.http.fetch(url, where)
        raise bad_request(f"{where}: unsupported media URL scheme {scheme!r}", "media_url_scheme", where)

    def _data_url(self, url: str, where: str) -> bytes:
        header, sep, payload = url.partition(",")
        if not sep or not header.lower().endswith(";base64"):
            raise bad_request(
                f"{where}: data URL must be 'data:<mime>;base64,<data>'", "invalid_data_url", where
            )
        if len(payload) * 3 // 4 > self.max_bytes:
            raise bad_request(
                f"{where}: media is larger than {self.max_bytes} bytes", "media_too_large", where
            )
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise bad_request(
                f"{where}: invalid base64 in data URL ({exc})", "invalid_base64", where
            ) from exc

    def _file_url(self, url: str, where: str) -> bytes:
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise bad_request(f"{where}: file URLs must be local", "file_not_allowed", where)
        path = os.path.realpath(unquote(parts.path))
        if not any(os.path.commonpath([path, d]) == d for d in self.allowed_dirs):
            raise bad_request(
                f"{where}: {path} is outside the directories allowed by --allowed-local-media-path",
                "file_not_allowed",
                where,
            )
        try:
            size = os.stat(path).st_size
            if not os.path.isfile(path):
                raise bad_request(f"{where}: {path} is not a regular file", "file_not_found", where)
            if size > self.max_bytes:
                raise bad_request(
                    f"{where}: media is larger than {self.max_bytes} bytes", "media_too_large", where
                )
            with open(path, "rb") as f:
                return f.read(size)
        except OSError as exc:
            raise bad_request(
                f"{where}: cannot read {path}: {exc.strerror}", "file_not_found", where
            ) from exc
