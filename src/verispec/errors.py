"""Errors verispec raises for bad input: each message says what is wrong and how to fix it.

An error about one setting of a request names it in `param` (given to the constructor:
`InvalidParameterError("top_p: …", param="top_p")`), which a server's 400 reports as the OpenAI
error's `param`.
"""

from __future__ import annotations


class VerispecError(Exception):
    """Base class of every error verispec raises on purpose; `param`: the request field it is about, if any."""

    def __init__(self, *args: object, param: str | None = None):
        super().__init__(*args)
        self.param = param


class ModelNotFoundError(VerispecError):
    """A model name or path that verispec cannot resolve to weights."""


class IncompatibleModelsError(VerispecError):
    """A draft that cannot serve a target (different tokenizer or vocabulary)."""


class InvalidParameterError(VerispecError, ValueError):
    """A sampling, drafting or generation parameter outside its valid range."""


class PromptError(VerispecError, ValueError):
    """An empty prompt, or one that does not fit in the model's context."""
