"""Run the app on uvicorn, as `verispec serve` does, stopping gracefully.

The first SIGTERM or Ctrl-C (SIGINT) begins a graceful stop: uvicorn stops listening and closes idle
connections, and the app refuses new requests and gives the running ones its `shutdown_grace` seconds
before it ends them (`verispec.serving.http.app.begin_shutdown`); whatever is still open
`SHUTDOWN_MARGIN` seconds after that is cancelled. A second signal exits at once.

Connections: at most `max_connections` open connections and requests at once (more: uvicorn answers
503), and an idle keep-alive connection is closed after `keep_alive` seconds.
"""

from __future__ import annotations

from collections.abc import Callable

import uvicorn
from fastapi import FastAPI
from rich.console import Console

from verispec.serving.http.app import begin_shutdown

__all__ = ["run", "SHUTDOWN_MARGIN"]

SHUTDOWN_MARGIN = 2.0  # seconds past the grace period for the last step, the final chunks and the app's own stop


class _GracefulServer(uvicorn.Server):
    """uvicorn, calling `on_first_signal` on the first SIGINT/SIGTERM and forcing the exit on the second
    (uvicorn alone forces it on a second SIGINT only), and `on_stopped` once the app has stopped (here: uvicorn
    raises the signal it caught again after `serve` returns, which ends the process before `run` could go on)."""

    def __init__(self, config: uvicorn.Config, on_first_signal: Callable[[], None], on_stopped: Callable[[], None]):
        super().__init__(config)
        self.on_first_signal, self.on_stopped = on_first_signal, on_stopped

    async def shutdown(self, sockets=None) -> None:
        await super().shutdown(sockets)  # the app's own stop (its lifespan) included
        self.on_stopped()

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit:
            self.force_exit = True
        else:
            self.on_first_signal()
        super().handle_exit(sig, frame)


def run(app: FastAPI, host: str, port: int, max_connections: int | None = None, keep_alive: float = 5.0) -> None:
    """Serve `app` (from `create_app`) until a signal stops it (see the module docstring); then one line on stderr of
    what it did (`Metrics.summary`)."""
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", limit_concurrency=max_connections,
                            timeout_keep_alive=keep_alive,
                            timeout_graceful_shutdown=app.state.shutdown_grace + SHUTDOWN_MARGIN)
    _GracefulServer(config, lambda: begin_shutdown(app), lambda: _say_what_it_did(app)).run()


def _say_what_it_did(app: FastAPI) -> None:
    if (scheduler := getattr(app.state, "scheduler", None)) is not None:  # none where the app never started
        Console(stderr=True, highlight=False).print(f"[dim]{scheduler.metrics.summary()}[/dim]")
