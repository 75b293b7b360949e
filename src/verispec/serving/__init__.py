"""Serving verispec: the OpenAI-compatible HTTP server (`http`), scale-out on Ray (`cluster`), and the
request helpers both share (`request`)."""
