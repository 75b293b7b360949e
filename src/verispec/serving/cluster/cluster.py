"""Joining or starting a Ray cluster.

`require_ray()` imports Ray or says how to install it. `ray_session()` connects to `address`
(`auto`, `ray://…`, `host:port`) or starts a local instance, and on exit shuts down only what it
started. What travels to replicas and actors is a `verispec.engine.spec.EngineSpec`, so that each
worker loads the target and drafter once, itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from verispec.errors import VerispecError

__all__ = ["RayNotInstalledError", "require_ray", "ray_session", "worker_threads"]


class RayNotInstalledError(VerispecError):
    """Ray is needed for this command but is not importable."""


def require_ray():
    """The `ray` module, or a clear error saying how to install it."""
    try:
        import ray
    except ImportError as error:
        raise RayNotInstalledError(
            f"this needs Ray, which is not installed ({error}): install the extra with "
            "`pip install 'verispec[ray]'` (or `pip install \"ray[serve,data]\" pyarrow`)"
        ) from None
    return ray


def worker_threads(num_cpus: float) -> int:
    """Torch threads for a worker that Ray gave `num_cpus` CPUs (at least one)."""
    return max(1, int(num_cpus))


@contextmanager
def ray_session(address: str | None = None, num_cpus: int | None = None, env_vars: dict[str, str] | None = None) -> Iterator[bool]:
    """Connect to Ray for the duration of the block; yields True when this call started the instance.

    address None starts a new local instance (never silently joins another cluster on this host);
    an address joins that cluster. If Ray is already initialised in this process it is used as is
    (and left running). env_vars go to every worker of this job (and to Serve's proxies if this job
    starts Serve).
    """
    ray = require_ray()
    if ray.is_initialized():
        yield False
        return
    runtime_env = {"env_vars": env_vars} if env_vars else None
    try:
        ray.init(address=address or "local", num_cpus=None if address else num_cpus, runtime_env=runtime_env,
                 include_dashboard=False, logging_level="warning")
    except ConnectionError as error:
        raise VerispecError(
            f"cannot reach the Ray cluster at {address!r} ({error}): start one with `ray start --head`, "
            "or pass the head's address (host:6379, or ray://host:10001 for a Ray client)") from None
    try:
        yield address is None
    finally:
        ray.shutdown()
