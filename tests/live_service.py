"""The `service` fixture: the whole service on a real local Ray cluster (127.0.0.1), with a
real redis-server session store, started once per test session (per xdist worker: tests that use
it are marked ``xdist_group("ray")`` so that they all run on one worker)."""

from __future__ import annotations

import grpc
import pytest

from blockspec.protos import blockspec_pb2_grpc as pb_grpc
from blockspec.service.config import Settings
from blockspec.workers.models import TINY_DRAFT, TINY_TARGET
from tests.redis_server import free_port

TINY_PAIR = dict(draft_dir=str(TINY_DRAFT), target_dir=str(TINY_TARGET))  # fast tests

APP = "blockspec-test"
MAX_BATCH, MAX_QUEUED = 8, 2


@pytest.fixture(scope="session")
def service(redis_url):
    import ray
    from ray import serve

    from blockspec.service.app import run

    settings = Settings(
        port=0,
        http_port=free_port(),
        metrics_port=free_port(),
        redis_url=redis_url,
        ray_num_cpus=4,
        replica=dict(**TINY_PAIR, max_batch=MAX_BATCH, max_queued=MAX_QUEUED, max_sessions=4),
    )
    gateway = run(settings, name=APP)
    address = gateway.address.remote().result()
    channel = grpc.insecure_channel(f"127.0.0.1:{address['port']}")
    replica = serve.get_deployment_handle("Replica", APP)
    yield dict(
        settings=settings,
        address=address,
        http=f"http://127.0.0.1:{settings.http_port}",
        channel=channel,
        stub=pb_grpc.GeneratorStub(channel),
        replica=replica,
    )
    channel.close()
    serve.shutdown()
    ray.shutdown()


def stop_remote_engine(engine) -> None:
    """Kill a test's own replica engine's actors and free its target placement group."""
    import ray

    for actor in engine.draft.actors + engine.target.actors:
        ray.kill(actor)
    ray.util.remove_placement_group(engine.target.placement_group)
