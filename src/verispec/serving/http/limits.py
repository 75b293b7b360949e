"""`ServerLimits`: what one server lets its clients ask of it, every limit's default and check in one place.

`verispec serve` takes them as options (`from_args`), `create_app` as keyword arguments and Ray Serve's
`ServeOptions` as fields (it is a ServerLimits: every replica gets the same). They are checked when they
are made, before any model loads: an InvalidParameterError names the option.

  max_batch          requests verified together in one target pass
  max_queue          requests allowed to wait; beyond that: HTTP 429
  request_timeout    seconds per request before HTTP 504
  max_tokens_limit   most new tokens one request may ask for; more: HTTP 400
  api_key            required as `Authorization: Bearer KEY` (`guard`); None: open
  cors_origins       browser origins allowed to call the API
  max_body_bytes     larger request bodies: HTTP 413
  body_timeout       seconds a body may take to arrive after its headers; longer: HTTP 408
  stall_seconds      /health is 503 degraded when the scheduler has work but has not advanced for this long
  prefill_chunk      prompt tokens prefilled per scheduler turn (None: measured, `prefill_chunks`; 0: whole)
  kv_pool_tokens     target KV positions the running requests share (None: `default_kv_pool_tokens`)
  max_model_len      most positions per request, prompt + new tokens (None: the target's context)
  shutdown_grace     seconds running requests may go on once a shutdown begins
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields

from verispec.errors import InvalidParameterError

__all__ = ["ServerLimits"]

OPTION_NAMES = {"request_timeout": "timeout", "cors_origins": "cors-origin"}  # `verispec serve`'s names where they differ


@dataclass(frozen=True)
class ServerLimits:
    """Every limit of one server (see the module docstring)."""

    max_batch: int = 8
    max_queue: int = 32
    request_timeout: float = 300.0
    max_tokens_limit: int = 4096
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    max_body_bytes: int = 1 << 20
    body_timeout: float = 30.0
    stall_seconds: float = 60.0
    prefill_chunk: int | None = None  # sized to the scheduler's time budgets (`prefill_chunks`)
    kv_pool_tokens: int | None = None
    max_model_len: int | None = None
    shutdown_grace: float = 10.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "cors_origins", tuple(self.cors_origins))  # any iterable of origins
        rules = [  # (holds, field, what it must be)
            (self.max_batch >= 1, "max_batch", "≥ 1"), (self.max_queue >= 1, "max_queue", "≥ 1"),
            (self.request_timeout > 0, "request_timeout", "> 0"), (self.max_tokens_limit >= 1, "max_tokens_limit", "≥ 1"),
            (self.max_body_bytes >= 1, "max_body_bytes", "≥ 1"), (self.body_timeout > 0, "body_timeout", "> 0"),
            (self.stall_seconds > 0, "stall_seconds", "> 0"), (self.shutdown_grace >= 0, "shutdown_grace", "≥ 0"),
            ((self.prefill_chunk or 0) >= 0, "prefill_chunk", "≥ 0 (0: whole prompts) or None"),
            (self.kv_pool_tokens is None or self.kv_pool_tokens >= 1, "kv_pool_tokens", "≥ 1 or None"),
            (self.max_model_len is None or self.max_model_len >= 2, "max_model_len", "≥ 2 or None"),
        ]
        for holds, name, rule in rules:
            if not holds:
                option = OPTION_NAMES.get(name, name.replace("_", "-"))
                raise InvalidParameterError(f"{name} (--{option}) must be {rule}, got {asdict(self)[name]}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerLimits:
        """The limits `verispec serve`'s options give (their destinations are the field names)."""
        return cls(**{field.name: vars(args)[field.name] for field in fields(ServerLimits)})

    def settings(self) -> dict:
        """The limits as `create_app`'s keyword arguments (as a Ray replica receives them)."""
        names = {field.name for field in fields(ServerLimits)}
        return {name: value for name, value in asdict(self).items() if name in names} | {"cors_origins": list(self.cors_origins)}
