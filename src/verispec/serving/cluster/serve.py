"""`verispec serve --ray`: the OpenAI-compatible app of `verispec.serving.http`, as replicas on Ray Serve.

Each replica runs `create_app(loader)`, the very app `verispec serve` runs (same endpoints, same
continuous-batching `Scheduler`), loading the target and drafter once when it starts. Serve's
proxy routes each request to a replica; with `min_replicas < max_replicas` Serve adds and removes
replicas to keep about `target_ongoing_requests` requests on each (default: `max_batch`, what one
replica verifies in one target pass). A replica accepts at most `max_batch + max_queue` requests,
the same limit beyond which a single server answers 429. Every limit of a single server (API key,
CORS origins, body size, time and token limits, stall time, prefill chunk, KV pool, max model length)
applies to each replica as given; `shutdown_grace` is how long Serve lets a stopping replica's
requests go on (its `graceful_shutdown_timeout_s`).

A replica that dies is replaced by Serve; its in-flight requests get a 503 with a message that says
to retry (`verispec.serving.cluster.proxy`), and new requests go to the live replicas. Responses carry
`x-verispec-replica` (Serve's replica id) and `x-verispec-pid`, so an answer can be traced to its
replica. Metrics: each replica's `/metrics` series are also exported through Ray's metrics system,
labelled by replica (`verispec.serving.cluster.metrics_mirror`).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

from verispec.engine.spec import EngineSpec
from verispec.errors import InvalidParameterError
from verispec.serving.cluster.cluster import require_ray, worker_threads
from verispec.serving.cluster.proxy import SERVE_PROXY_ENV
from verispec.serving.http.limits import ServerLimits

__all__ = ["ServeOptions", "VerispecReplica", "application", "build_app", "deploy", "serve_running", "run_cli", "APP_NAME", "SERVE_PROXY_ENV"]

APP_NAME = "verispec"


@dataclass(frozen=True)
class ServeOptions(ServerLimits):
    """How many replicas, what each may take on (the limits of a single server, the same on every
    replica: the API key travels in the deployment's arguments), and where Serve listens."""

    replicas: int = 1
    min_replicas: int | None = None  # both set: autoscaling between them
    max_replicas: int | None = None
    replica_cpus: float = 1.0
    target_ongoing_requests: float | None = None  # default: max_batch
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None
    app_name: str = APP_NAME

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise InvalidParameterError("autoscaling needs both --min-replicas and --max-replicas")
        if self.min_replicas is not None and not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas == 0:
            raise InvalidParameterError(
                f"need 0 ≤ --min-replicas ≤ --max-replicas and --max-replicas ≥ 1, got {self.min_replicas} and {self.max_replicas}")
        if self.replicas < 1:
            raise InvalidParameterError(f"--replicas must be ≥ 1, got {self.replicas}")
        if self.replica_cpus <= 0:
            raise InvalidParameterError(f"--replica-cpus must be > 0, got {self.replica_cpus}")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None

    def deployment_options(self) -> dict:
        scale = ({"autoscaling_config": {
            "min_replicas": self.min_replicas, "max_replicas": self.max_replicas, "initial_replicas": max(self.min_replicas, 1),
            "target_ongoing_requests": self.target_ongoing_requests or self.max_batch,
        }} if self.autoscaling else {"num_replicas": self.replicas})
        return {**scale, "max_ongoing_requests": self.max_batch + self.max_queue,
                "graceful_shutdown_timeout_s": self.shutdown_grace, "ray_actor_options": {"num_cpus": self.replica_cpus}}

    def app_options(self) -> dict:
        """`create_app`'s keyword arguments on every replica."""
        return {"model_name": self.model_name, **self.settings()}


class _ReplicaHeaders:
    """ASGI middleware: every response says which replica (and process) produced it."""

    def __init__(self, app, replica: str):
        self.app = app
        self.headers = [(b"x-verispec-replica", replica.encode()), (b"x-verispec-pid", str(os.getpid()).encode())]

    async def __call__(self, scope, receive, send) -> None:
        async def tagged(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *self.headers]}
            await send(message)

        await self.app(scope, receive, tagged if scope["type"] == "http" else send)


class VerispecReplica:
    """One Serve replica: `verispec.serving.http`'s app over an engine this replica loads itself.

    Wrapped by `serve.ingress()` (late-bound: Serve calls `__serve_build_asgi_app__` after
    `__init__`, then runs the app's lifespan, which loads the models) and `serve.deployment`.
    """

    def __init__(self, loader: Callable, app_options: dict, num_cpus: float):
        import torch

        torch.set_num_threads(worker_threads(num_cpus))
        self._loader, self._app_options = loader, app_options
        self._mirror = None

    def __serve_build_asgi_app__(self):
        from ray import serve

        from verispec.serving.cluster.metrics_mirror import MetricsMirror
        from verispec.serving.http import create_app

        app = create_app(self._loader, **self._app_options)
        app.add_middleware(_ReplicaHeaders, replica=serve.get_replica_context().replica_id.unique_id)
        self._mirror = MetricsMirror(app.state.metrics).start()
        return app

    def __del__(self) -> None:
        if self._mirror is not None:
            self._mirror.stop()


def serve_running() -> bool:
    """Whether Serve (its controller) already runs on the connected cluster."""
    from ray.serve.context import _get_global_client

    return _get_global_client(raise_if_no_controller_running=False) is not None


def _http_address() -> tuple[str, int]:
    """Where Serve's proxies actually listen (a Serve started earlier keeps its own host and port)."""
    from ray.serve.context import _get_global_client

    config = _get_global_client().http_config
    return config.host, config.port


def application(loader: Callable, options: ServeOptions):
    """The Serve application (not yet running): the deployment, with its options, bound to `loader`."""
    require_ray()
    from ray import serve

    deployment = serve.deployment(serve.ingress()(VerispecReplica), name="VerispecReplica")
    return deployment.options(**options.deployment_options()).bind(loader, options.app_options(), options.replica_cpus)


def build_app(args: dict):
    """Application builder for `serve run verispec.serving.cluster.serve:build_app key=value …` and KubeRay's
    RayService (`import_path: verispec.serving.cluster.serve:build_app`, `args:`). Keys: the fields of
    `EngineSpec` (target, draft, dtype, gamma, gamma_policy, device) and of `ServeOptions` except host, port and
    app_name, which belong to Serve's own config there. Values may be strings, as `serve run` passes them."""
    spec_fields = {f.name: f for f in fields(EngineSpec)}
    option_fields = {f.name: f for f in fields(ServeOptions) if f.name not in ("host", "port", "app_name")}
    unknown = sorted(set(args) - set(spec_fields) - set(option_fields))
    if unknown:
        raise InvalidParameterError(f"unknown argument(s) {', '.join(unknown)}: use {', '.join([*spec_fields, *option_fields])}")

    def typed(field, value):
        if value is None or not isinstance(value, str) or value.lower() == "none":
            return None if isinstance(value, str) else value
        kind = str(field.type)
        if kind.startswith("tuple"):
            return tuple(item.strip() for item in value.split(",") if item.strip())
        return int(value) if kind.startswith("int") else float(value) if kind.startswith("float") else value

    spec = EngineSpec(**{k: typed(spec_fields[k], v) for k, v in args.items() if k in spec_fields})
    options = ServeOptions(**{k: typed(option_fields[k], v) for k, v in args.items() if k in option_fields})
    return application(spec, options)


def deploy(loader: Callable, options: ServeOptions) -> str:
    """Start Serve if needed, deploy the app and wait until every replica has loaded; returns its URL."""
    require_ray()
    from ray import serve

    if not serve_running():
        serve.start(http_options={"host": options.host, "port": options.port})
    serve.run(application(loader, options), name=options.app_name, route_prefix="/")
    host, port = _http_address()
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"


def _metrics_endpoints() -> list[str]:
    import ray

    return [f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
            for node in ray.nodes() if node.get("Alive") and node.get("MetricsExportPort")]


def run_cli(loader, options: ServeOptions, address: str | None, describe: str) -> int:
    """Deploy, print where to reach it, serve until Ctrl-C or SIGTERM, then leave the cluster as found."""
    from rich.console import Console

    from verispec.serving.cluster.cluster import ray_session

    console = Console(stderr=True, highlight=False)
    with ray_session(address, env_vars=SERVE_PROXY_ENV) as started_here:
        from ray import serve

        serve_was_running = serve_running()
        scale = (f"{options.min_replicas}–{options.max_replicas} replicas (autoscaling)" if options.autoscaling
                 else f"{options.replicas} replica{'s' * (options.replicas > 1)}")
        console.print(f"deploying {scale} on Ray ({'a new local instance' if started_here else address}): {describe}")
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # SIGTERM cleans up like Ctrl-C, even mid-deploy
        try:
            url = deploy(loader, options)
            console.print(f"serving on {url} through Ray Serve (OpenAI API under /v1, playground at /)")
            console.print("Prometheus: scrape " + ", ".join(_metrics_endpoints()) + " — verispec's series are "
                          "ray_verispec_*, one per replica (tag 'replica')")
            if serve_was_running:
                console.print("[yellow]note:[/yellow] Serve was already running on this cluster: its proxies keep their "
                              "own address and options (a lost replica then shows as a plain 500)")
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            console.print("stopping: removing the deployment")
        finally:
            signal.signal(signal.SIGTERM, previous)
            if serve_was_running:
                serve.delete(options.app_name)
            else:
                serve.shutdown()
    return 0


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
