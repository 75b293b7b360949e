"""A Ray Serve proxy middleware: a request whose replica died gets a clear, retryable answer, never a hang.

When the replica process serving a request dies, Ray Serve's HTTP proxy ends the request without
sending anything (the client would see a bare "500 Internal Server Error", or a stream that just
stops). This ASGI middleware wraps the proxy and notices such requests: one that never started its
response becomes a 503 with the API's usual error body and `Retry-After: 1` (OpenAI clients retry a
503 by themselves); a stream that was cut off gets a final SSE error event, then `[DONE]`.

Ray loads it in every proxy process from `SERVE_PROXY_ENV` (set on the job that starts Serve).
"""

from __future__ import annotations

import logging

from starlette.middleware import Middleware

from verispec.serving.http.errors import error_response
from verispec.serving.http.formats import sse

__all__ = ["ReplicaLossMiddleware", "proxy_middlewares", "SERVE_PROXY_ENV", "REPLICA_LOST_CODE"]

REPLICA_LOST_CODE = "replica_lost"
REPLICA_LOST_MESSAGE = (
    "the Ray Serve replica handling this request stopped before it finished answering (its process died or "
    "was restarted); nothing more will come for this request: retry it, the other replicas keep serving and "
    "Ray replaces the lost one"
)
logger = logging.getLogger(__name__)
SERVE_PROXY_ENV = {
    "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": f"{__name__}.proxy_middlewares",
    # Serve's controller kills a proxy that misses 3 readiness checks of 5 s; on a busy 2-core machine
    # a starting proxy missed them (and `serve.start` failed), so give it 30 s per check.
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30",
}


class ReplicaLossMiddleware:
    """Pure ASGI: watches what the wrapped app sends and completes what it left unanswered."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = finished = streaming = False

        async def watched_send(message) -> None:
            nonlocal started, finished, streaming
            if message["type"] == "http.response.start":
                started = True
                content_type = dict(message.get("headers") or []).get(b"content-type", b"")
                streaming = content_type.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except Exception:  # noqa: BLE001 — the proxy itself failed: answer the client all the same
            logger.exception("the Ray Serve proxy failed while relaying a request")
        if not finished:
            await self._complete(scope, receive, send, started, streaming)

    @staticmethod
    async def _complete(scope, receive, send, started: bool, streaming: bool) -> None:
        try:
            if not started:
                response = error_response(503, REPLICA_LOST_MESSAGE, code=REPLICA_LOST_CODE)
                response.headers["retry-after"] = "1"
                await response(scope, receive, send)
            elif streaming:
                event = {"error": {"message": REPLICA_LOST_MESSAGE, "type": "server_error", "code": REPLICA_LOST_CODE}}
                await send({"type": "http.response.body", "body": (sse(event) + sse("[DONE]")).encode(), "more_body": False})
            else:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except Exception:  # noqa: BLE001 — the client is gone too: nothing left to tell it
            pass


def proxy_middlewares() -> list[Middleware]:
    """The callback Ray Serve's proxy calls (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH)."""
    return [Middleware(ReplicaLossMiddleware)]
