"""ASGI middleware in front of the API: the API key, and the request body's size and encoding.

`Guard` answers before any handler runs, with the OpenAI error envelope:
  401 any path but /health and the playground (/) without `Authorization: Bearer <key>` (when the
      server has a key; compared in constant time): the API, /metrics, /openapi.json and /docs
  413 a body larger than `max_body_bytes` (by its Content-Length, or counted while it arrives)
  408 a body not all there `body_timeout` seconds after the headers (a client that stalls mid-body
      would hold its connection open forever)
  400 a body that is not UTF-8 (JSON must be), or that nests arrays and objects more than
      `MAX_JSON_DEPTH` deep (Python's parser would run out of stack; no request needs it)
It reads the whole body (at most `max_body_bytes`) and hands it on unchanged.
"""

from __future__ import annotations

import asyncio
import hmac
import re

from starlette.responses import Response

from verispec.serving.http.errors import error_response

__all__ = ["Guard", "OPEN_PATHS", "MAX_JSON_DEPTH", "json_too_deep"]

OPEN_PATHS = frozenset({"/", "/health"})  # without the key: the playground (it has a key field) and health checks
MAX_JSON_DEPTH = 64  # a json_schema may nest ~30 levels of properties within it
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string: its brackets are text, not nesting
_NOT_BRACKET = re.compile(rb"[^\[\]{}]+")


def json_too_deep(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text `body` nests arrays and objects more than `limit` deep (counted on the
    brackets outside strings, so that it costs little whatever the body holds)."""
    depth = 0
    for byte in _NOT_BRACKET.sub(b"", _STRING.sub(b"", body)):
        depth += 1 if byte in b"[{" else -1
        if depth > limit:
            return True
    return False


class Disconnected(Exception):
    """The client went away while sending its body."""


class Guard:
    """The limits are a `ServerLimits`' (defaults and checks there)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, body_timeout: float):
        self.app, self.max_body_bytes, self.body_timeout = app, max_body_bytes, body_timeout
        self.api_key = api_key.encode() if api_key else None

    def _authorized(self, scope) -> bool:
        if self.api_key is None or scope["path"] in OPEN_PATHS:
            return True
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        return hmac.compare_digest(token.strip() if scheme.lower() == b"bearer" else b"", self.api_key)

    def _too_large(self) -> Response:
        return error_response(413, f"the request body is larger than this server's limit of {self.max_body_bytes} bytes",
                              code="body_too_large")

    async def _read_body(self, scope, receive) -> bytes | Response:
        """The whole body, or the error answer: too large (413) or not all there within `body_timeout` (408).
        Raises Disconnected."""
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return self._too_large()
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise Disconnected
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    if size > self.max_body_bytes:
                        return self._too_large()
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            return error_response(408, f"the request body did not arrive within {self.body_timeout:g} s, this server's limit "
                                  f"({size} bytes came): send it whole", code="body_timeout", headers={"Connection": "close"})

    @staticmethod
    def _check_body(body: bytes) -> Response | None:
        """The error answer for a body that is not UTF-8 or nests too deep, else None."""
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as error:
            return error_response(400, f"the request body is not valid UTF-8 (byte {error.start}): send JSON encoded as UTF-8")
        if json_too_deep(body):
            return error_response(400, f"the request body nests JSON arrays and objects more than {MAX_JSON_DEPTH} levels "
                                  f"deep, this server's limit: flatten it", code="json_too_deep")
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["method"] != "OPTIONS" and not self._authorized(scope):  # CORS preflights carry no key
            response = error_response(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                                      code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        try:
            body = await self._read_body(scope, receive)
        except Disconnected:
            return None
        refusal = body if isinstance(body, Response) else self._check_body(body)
        if refusal is not None:
            return await refusal(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # later: the client's disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)
