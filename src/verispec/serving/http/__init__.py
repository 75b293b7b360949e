"""OpenAI-compatible server: HTTP API (app), continuous batching (scheduler), metrics, playground.

`create_app` is imported on first use, so that the batch job can import the schemas and the error
envelope without loading the app."""

__all__ = ["create_app"]


def __getattr__(name: str):
    if name == "create_app":
        from verispec.serving.http.app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
