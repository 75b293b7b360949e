"""OpenAI-compatible server: HTTP API (app), continuous batching (scheduler), metrics, playground."""

from verispec.serving.http.app import create_app

__all__ = ["create_app"]
