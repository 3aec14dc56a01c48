"""CORS: off unless ``--allowed-origins`` names the origins (or ``*``) whose pages may call the API."""

from __future__ import annotations

from aiohttp import web

from mmcache.processor.errors import error_response

_METHODS = "GET, POST, OPTIONS"
_MAX_AGE = "600"  # seconds a browser may reuse a preflight answer


def setup_cors(app: web.Application, origins: list[str]) -> None:
    """Answer preflights and mark every response (streams too) for the allowed origins."""
    allow_any = "*" in origins
    allowed = frozenset(origins)

    def allowed_origin(request: web.Request) -> str | None:
        origin = request.headers.get("Origin")
        return origin if origin is not None and (allow_any or origin in allowed) else None

    @web.middleware
    async def preflight(request: web.Request, handler) -> web.StreamResponse:
        if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers:
            return await handler(request)
        if allowed_origin(request) is None:
            origin = request.headers.get("Origin")
            return error_response(403, f"origin {origin!r} is not allowed", "origin_not_allowed")
        resp = web.Response(status=204)
        resp.headers["Access-Control-Allow-Methods"] = _METHODS
        asked = request.headers.get("Access-Control-Request-Headers")
        if asked:
            resp.headers["Access-Control-Allow-Headers"] = asked
        resp.headers["Access-Control-Max-Age"] = _MAX_AGE
        return resp

    async def mark(request: web.Request, resp: web.StreamResponse) -> None:
        # NOTE: on_response_prepare runs before any response's headers go out, a stream's included.
        origin = allowed_origin(request)
        if origin is not None:
            resp.headers["Access-Control-Allow-Origin"] = "*" if allow_any else origin
            if not allow_any:
                resp.headers["Vary"] = "Origin"

    app.middlewares.append(preflight)
    app.on_response_prepare.append(mark)
