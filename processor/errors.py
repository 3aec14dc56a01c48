"""OpenAI-style errors: ``{"error": {"message", "type", "code", "param"}}`` with a 4xx/5xx status."""

from __future__ import annotations

import logging

from aiohttp import web

log = logging.getLogger(__name__)

# NOTE: the ``type`` names OpenAI's API sends: every client error is an invalid request except
# these; every 5xx is a server error.
_CLIENT_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


def error_type(status: int) -> str:
    if status >= 500:
        return "server_error"
    return _CLIENT_TYPES.get(status, "invalid_request_error")


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param

    def response(self) -> web.Response:
        return error_response(self.status, self.message, self.code, self.param)


def bad_request(message: str, code: str = "invalid_request", param: str | None = None) -> APIError:
    return APIError(400, message, code, param)


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": error_type(status),
            "code": code,
            "param": param,
        }
    }


def error_response(status: int, message: str, code: str, param: str | None = None) -> web.Response:
    return web.json_response(error_body(status, message, code, param), status=status)


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Every failure leaves as a JSON error; nothing a client sends takes the server down."""
    try:
        return await handler(request)
    except APIError as exc:
        return exc.response()
    except web.HTTPRequestEntityTooLarge:
        limit = request.client_max_size
        return error_response(
            413, f"request body is larger than the limit of {limit} bytes", "request_too_large"
        )
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = f"{request.method} {request.path}: {exc.reason.lower()}"
        return error_response(exc.status, message, exc.reason.lower().replace(" ", "_"))
    except Exception:
        log.exception("unhandled error for %s %s", request.method, request.path)
        return error_response(500, "internal server error", "internal_error")
