"""The Ray Serve application: a `Replica` deployment (autoscaled) behind a `Gateway` deployment
that serves gRPC and, through Serve's HTTP proxy, the OpenAI-compatible HTTP API.
`app_builder` is the import path of deploy/serve_config.yaml and of the KubeRay
RayService; `blockspec serve` runs the same application on a local cluster.
"""

import os
from typing import Any

import ray
from fastapi import Request
from ray import serve

from blockspec.service.config import Settings
from blockspec.service.http_api import OpenAIFrontend, http_app
from blockspec.service.ports import SERVE_EXCLUSIVE_ENV
from blockspec.service.replica import Replica

# What a local cluster's processes (GCS, raylet, Serve's controller and proxy, the actors) read
# at start. RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: listen on 127.0.0.1 only; a real cluster's pods
# set 1 (deploy/). RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S: Serve kills an HTTP proxy that fails 3
# readiness checks of this many seconds (Ray's default 5: 15 s in all) and starts another. On a
# busy 2-core host a proxy starting beside the replicas' model loads can need longer, and the
# restart then outlasts serve.start's fixed 60 s wait for it; 20 s gives the first proxy the
# whole minute. SERVE_EXCLUSIVE_ENV: the HTTP proxy's port is ours alone (service/ports.py).
LOCAL_CLUSTER_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "20",
    **SERVE_EXCLUSIVE_ENV,
}


# No `from __future__ import annotations` here: FastAPI reads the routes' `Request`
# annotations at definition time, through Serve's class-based view.
@serve.ingress(http_app)
class Gateway:
    """Hosts service.gateway.GatewayServer (gRPC) in a Serve replica (one; it is only an
    ingress), and behind Serve's HTTP proxy the OpenAI-compatible API over the same request
    path (service/http_api.py)."""

    async def __init__(self, replicas, settings: dict[str, Any]):
        from blockspec.service.gateway import GatewayServer

        self.settings = Settings.model_validate(settings)
        info = await replicas.info.remote()
        self.server = GatewayServer(self.settings, replicas, info)
        self.http = OpenAIFrontend(self.server.core, info.target_model)
        await self.server.start()

    @http_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self.http.complete(request, chat=True)

    @http_app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self.http.complete(request, chat=False)

    @http_app.get("/v1/models")
    async def models(self, request: Request):
        return self.http.list_models(request)

    @http_app.get("/v1/models/{model_id:path}")
    async def model(self, request: Request, model_id: str):
        return self.http.get_model(request, model_id)

    @http_app.get("/v1/blockspec/info")
    async def info(self, request: Request):
        return await self.http.info(request)

    async def address(self) -> dict[str, Any]:
        return dict(port=self.server.port, metrics_port=self.server.metrics_port)

    async def drain(self) -> None:
        await self.server.drain()

    async def __del__(self):
        await self.server.drain()


def build(settings: Settings) -> serve.Application:
    cfg = settings.replica
    replica = serve.deployment(
        Replica,
        name="Replica",
        ray_actor_options=dict(
            num_cpus=cfg.coordinator.num_cpus, num_gpus=cfg.coordinator.num_gpus
        ),
        autoscaling_config=settings.autoscaling.serve_config(),
        # Serve sends a replica at most this many requests; the coordinator batches max_batch
        # of them and queues the rest, so the handle's queue fills only when all are busy.
        max_ongoing_requests=cfg.max_batch + cfg.max_queued,
        # Beyond that, up to one replica's worth more wait at the gateway's handle (they tell
        # the autoscaler to add replicas); the next ones get RESOURCE_EXHAUSTED at once. Serve
        # counts requests still being routed as queued, so a smaller limit would reject bursts
        # that the replicas have room for (seen here with a limit of 2 and 4 clients). It also
        # counts a request only after checking the limit, so a burst can overshoot it: the
        # gateway enforces its own bound, (max_replicas + 1) replicas' worth.
        max_queued_requests=cfg.max_batch + cfg.max_queued,
        graceful_shutdown_timeout_s=settings.drain_timeout_s,
    )
    gateway = serve.deployment(
        Gateway,
        name="Gateway",
        num_replicas=1,
        ray_actor_options=dict(num_cpus=0),
        max_ongoing_requests=16,
        graceful_shutdown_timeout_s=settings.drain_timeout_s,
    )
    return gateway.bind(replica.bind(cfg.model_dump()), settings.model_dump())


def app_builder(args: dict[str, Any]) -> serve.Application:
    """`serve run` / `serve deploy` / RayService entry point: args are Settings fields."""
    return build(Settings.model_validate(args))


def start_ray(settings: Settings) -> None:
    """Join settings.ray_address (or RAY_ADDRESS), else start a local cluster on 127.0.0.1."""
    if ray.is_initialized():
        return
    address = settings.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
        return
    _local_cluster_env()
    # "local": always a new cluster of our own. Without it ray.init joins whatever cluster
    # /tmp/ray/ray_current_cluster names (another job's `ray start` on this machine, such as
    # tests/two_nodes.py running beside the live-service tests), and then refuses num_cpus.
    ray.init(
        address="local",
        num_cpus=settings.ray_num_cpus or os.cpu_count(),
        include_dashboard=False,
        runtime_env={
            "env_vars": {key: os.environ[key] for key in LOCAL_CLUSTER_ENV},  # as set above
            "worker_process_setup_hook": "blockspec.service.app.serve_replicas_on_loopback",
        },
    )


def _local_cluster_env() -> None:
    """Set LOCAL_CLUSTER_ENV for the local cluster that ray.init is about to start (an explicit
    setting wins): 127.0.0.1 only, and a patient Serve proxy readiness check.

    The processes ray.init starts (GCS, raylet, agents) and the workers the raylet forks inherit
    this environment; the job's workers also get it through its runtime_env. This process read
    the loopback variable when it first imported ray, possibly before this call: read it again.
    """
    from ray._private import ray_constants

    for key, value in LOCAL_CLUSTER_ENV.items():
        os.environ.setdefault(key, value)
    ray_constants.ENABLE_RAY_CLUSTER = ray_constants.env_bool(
        ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, ray_constants.ENABLE_RAY_CLUSTER
    )


def serve_replicas_on_loopback() -> None:
    """Worker setup hook of a local cluster: Serve replicas' own gRPC server on 127.0.0.1.

    Every Serve replica starts a gRPC server for calls between deployments and binds it to
    "[::]:0", all interfaces, with no setting to change it (Ray 2.60; ray-project/ray#64544).
    A local cluster's every other listener is on 127.0.0.1, and its replicas reach each other
    there, so the same address serves them. Only local clusters run this hook (start_ray)."""
    from ray.serve._private import replica

    bind = replica.add_port_to_grpc_server

    def on_loopback(server, address: str) -> int:
        return bind(server, address.replace("[::]:", "127.0.0.1:", 1))

    replica.add_port_to_grpc_server = on_loopback


def run(settings: Settings, name: str | None = None):
    """Start (or join) Ray and the application; returns the gateway's handle."""
    start_ray(settings)
    name = name or settings.app_name
    if not settings.http_port:
        serve.start(proxy_location="Disabled")
        return serve.run(build(settings), name=name, route_prefix=None)
    # Serve's HTTP proxy, on the head node, for the OpenAI-compatible API
    serve.start(
        proxy_location="HeadOnly", http_options=dict(host=settings.host, port=settings.http_port)
    )
    return serve.run(build(settings), name=name, route_prefix="/")
