"""API key checks and the request size cap, for the HTTP API and the ZMQ front.

The HTTP side is a plain ASGI middleware rather than a FastAPI dependency so that it
refuses before any route reads (or FastAPI parses) a body, and so that it covers every
route, the docs and unknown paths alike; streaming responses pass through untouched.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenizer_proc.errors import RequestError

# Load balancers and orchestrators probe this without credentials.
OPEN_PATHS = frozenset({"/health"})


class ApiKey:
    """The server's key; an empty key means no authentication."""

    def __init__(self, key: str = "") -> None:
        self._digest = _digest(key) if key else None

    @property
    def required(self) -> bool:
        return self._digest is not None

    def accepts(self, given: str | None) -> bool:
        if self._digest is None:
            return True
        # Comparing digests keeps the time independent of both the content and the length.
        return given is not None and hmac.compare_digest(_digest(given), self._digest)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def invalid_key_error() -> RequestError:
    return RequestError("Missing or incorrect API key. Send 'Authorization: Bearer <key>' "
                        "(or 'x-api-key: <key>').",
                        code="invalid_api_key", status=401)


def too_large_error(limit: int) -> RequestError:
    return RequestError(f"The request body is larger than this server's limit of {limit} "
                        "bytes (--max-request-bytes).", code="request_too_large", status=413)


def bearer_token(headers: Headers) -> str | None:
    """The token of an 'Authorization: Bearer <token>' header (scheme case-insensitive)."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


class HttpGuard:
    """ASGI middleware: the API key on every route but /health, and the body size cap.

    A body whose Content-Length is over the cap is refused before it is read; a body
    without one (chunked) is counted as it arrives, and the read that crosses the cap
    raises a 413 RequestError inside the route.
    """

    def __init__(self, app: ASGIApp, api_key: ApiKey, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await _error_response(refusal, scope["path"])(scope, receive, send)
            return
        await self.app(scope, BodyCounter(receive, self.max_body_bytes), send)

    def _refusal(self, scope: Scope) -> RequestError | None:
        headers = Headers(scope=scope)
        # Anthropic's clients send the key as x-api-key; OpenAI's as a bearer token.
        given = bearer_token(headers) or headers.get("x-api-key")
        if scope["path"] not in OPEN_PATHS and not self.api_key.accepts(given):
            return invalid_key_error()
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return too_large_error(self.max_body_bytes)
        return None


class BodyCounter:
    """An ASGI `receive` that raises a 413 once the body passes `limit` bytes."""

    def __init__(self, receive: Receive, limit: int) -> None:
        self._receive = receive
        self._limit = limit
        self._seen = 0

    async def __call__(self) -> Message:
        message = await self._receive()
        if message["type"] == "http.request":
            self._seen += len(message.get("body", b""))
            if self._seen > self._limit:
                raise too_large_error(self._limit)
        return message


def _error_response(error: RequestError, path: str) -> JSONResponse:
    headers: dict[str, Any] = {}
    if error.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(error.body(path), status_code=error.status, headers=headers)
