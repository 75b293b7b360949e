"""OpenAI-compatible server: HTTP API (app), continuous batching (scheduler), metrics, playground.

`create_app` is imported on first use, so that `verispec.serving.request` can import the schemas
without loading the app (which imports it back)."""

__all__ = ["create_app"]


def __getattr__(name: str):
    if name == "create_app":
        from verispec.serving.http.app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
