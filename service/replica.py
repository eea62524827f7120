"""A replica of the service: one coordinator with its draft actor and target shard group, as a
Ray Serve deployment (autoscaled by Serve on the number of ongoing requests).

The gateway calls `generate` with a checked `GenerationRequest` (token ids; a session's history
already prepended) and `stream=True`; it yields a `TokensEvent` per decode step that produced
tokens (for a request `read_at_end`, the first step's and then the rest at once) and a final
`FinishedEvent` with the finish reason and the request's speculation stats
(service/requests.py); `info` and `stats` describe the replica (`ReplicaInfo`,
`ReplicaStats`). Requests of a session are routed with the session id as Serve's *multiplexed
model id*: Serve then prefers the replica that last "loaded" that id, i.e. the one whose engine
parked the session's KV cache. If that replica is gone, any other rebuilds the
cache from the history the gateway sends; nothing is lost.

Step-level metrics (step time by phase, batch size, queue depth) go to Ray's metrics agent
(`ray.util.metrics`), which Prometheus scrapes per node.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from blockspec.service.config import ReplicaConfig, Resources
from blockspec.service.coordinator import Coordinator, Done, Emitted, Event, Failed
from blockspec.service.engine import SpeculativeEngine
from blockspec.service.policy import AUTO, AutoPolicy
from blockspec.service.requests import (
    FinishedEvent,
    GenerationRequest,
    MethodInfo,
    ReplicaInfo,
    ReplicaStats,
    TokensEvent,
)
from blockspec.service.results import StepTimes
from blockspec.service.warm_up import WarmUp, warm_up
from blockspec.verification import VERIFIERS

SESSION_ROUTING_CAPACITY = 4096  # session ids Serve remembers per replica (routing hints only)


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve (tests of the class itself)
        return uuid.uuid4().hex[:8]


def _step_metrics():
    from ray.util import metrics

    boundaries = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0]
    phase = metrics.Histogram(
        "blockspec_step_phase_seconds",
        "Seconds of one decode step spent per phase (draft/tree/target/transfer/verify/overhead)",
        boundaries=boundaries,
        tag_keys=("phase",),
    )
    batch = metrics.Histogram(
        "blockspec_step_batch_size",
        "Requests decoded together in one step",
        boundaries=[1, 2, 4, 8, 16, 32, 64],
    )
    depth = metrics.Gauge("blockspec_queue_depth", "Requests waiting for a batch slot")

    def record(step: StepTimes, waiting: int) -> None:
        for name in StepTimes.PHASES:
            phase.observe(getattr(step, name), tags={"phase": name})
        batch.observe(step.batch_size)
        depth.set(waiting)

    return record


def build_remote_engine(cfg: ReplicaConfig) -> tuple[SpeculativeEngine, dict[str, Any]]:
    """Engine over a draft actor and the target shard group (a `RemoteRunner`); returns
    (engine, model info)."""
    from blockspec.workers.actors import ActorSpec, RemoteRunner, start_draft, start_target
    from blockspec.workers.compiled import DecodeForwards
    from blockspec.workers.models import check_pair

    _, vocab_size, context = check_pair(cfg.draft_dir, cfg.target_dir)
    max_len = min(cfg.max_len, context)
    slots = cfg.max_batch + cfg.max_sessions

    def actor_spec(path: str, per_actor: Resources) -> ActorSpec:
        cpus, gpus, custom = per_actor.num_cpus, per_actor.num_gpus, per_actor.resources
        forwards = DecodeForwards(cfg.cuda_graphs, cfg.compiled)
        threads = cfg.torch_threads
        return ActorSpec(path, cfg.dtype, cfg.device, threads, cpus, gpus, custom, forwards)

    speculation = (cfg.speculation, cfg.speculation_downweight, cfg.speculation_max_batch)
    draft = start_draft(actor_spec(cfg.draft_dir, cfg.draft), slots, max_len, speculation)
    target_spec = actor_spec(cfg.target_dir, cfg.target_shard)
    target = start_target(target_spec, cfg.tensor_parallel, slots, max_len)
    draft.step_timeout_s = target.step_timeout_s = cfg.step_timeout_s
    draft.wait_ready()  # loaded while the target shards were starting
    target.use_draft(draft)
    policy = AutoPolicy(cfg.auto_arms)
    engine = SpeculativeEngine(
        RemoteRunner(draft, target),
        cfg.max_batch,
        max_len,
        vocab_size,
        cfg.max_sessions,
        policy,
        cfg.prefix_caching,
    )
    info = dict(
        draft_model=os.path.basename(cfg.draft_dir.rstrip("/")),
        target_model=os.path.basename(cfg.target_dir.rstrip("/")),
        vocab_size=engine.vocab_size,
        max_context=max_len,
        tensor_parallel=cfg.tensor_parallel,
    )
    return engine, info


def warm_replica(engine, cfg: ReplicaConfig, samplings=None) -> WarmUp:
    """What a replica runs before it serves (service/warm_up.py): the graphs of its declared
    shapes captured where graphs are on (CUDA), its forwards compiled with `compiled`."""
    return warm_up(engine, cfg.warm_shapes(), samplings, compiles=cfg.compiled)


def _pid(_actor) -> int:
    return os.getpid()


AUTO_DESCRIPTION = "picks method, K and γ each step from measured load (k, gamma ignored)"


class Replica:
    """Serve deployment class (bound in service/app.py with the replica's ReplicaConfig)."""

    def __init__(self, config: dict[str, Any]):
        self.cfg = ReplicaConfig.model_validate(config)
        self.id = _replica_id()
        engine, self.model_info = build_remote_engine(self.cfg)
        warm_replica(engine, self.cfg)
        self.coordinator = Coordinator(engine, self.cfg.max_queued, _step_metrics())
        self._ids = itertools.count()

    @serve.multiplexed(max_num_models_per_replica=SESSION_ROUTING_CAPACITY)
    async def _route_session(self, session_id: str) -> str:
        # Marks the session as "loaded" here, so Serve routes its next request to this replica.
        return session_id

    async def generate(
        self, request: GenerationRequest
    ) -> AsyncIterator[TokensEvent | FinishedEvent]:
        request_id = f"{self.id}-{next(self._ids)}"
        if request.session_id:
            await self._route_session(request.session_id)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def deliver(event: Event) -> None:  # on the coordinator's thread
            loop.call_soon_threadsafe(events.put_nowait, event)

        self.coordinator.submit(request_id, request, deliver)
        finished, sent = False, 0  # sent: output tokens yielded so far
        try:
            while True:
                match await events.get():
                    case Emitted(progress) if progress.token_ids:
                        sent += len(progress.token_ids)
                        yield TokensEvent(
                            progress.token_ids, progress.stats, progress.cached_tokens, self.id
                        )
                    case Failed(error):
                        finished = True
                        raise error
                    case Done(result):
                        finished = True
                        if rest := result.token_ids[sent:]:  # read_at_end's, past the first step
                            yield TokensEvent(list(rest), None, result.cached_tokens, self.id)
                        yield FinishedEvent(
                            result.finish_reason, result.stats, result.cached_tokens, self.id
                        )
                        return
        finally:
            if not finished:  # the client went away (cancelled, deadline): free its KV slot
                self.coordinator.cancel(request_id)

    async def info(self) -> ReplicaInfo:
        cfg = self.cfg
        methods = [MethodInfo(v.name, v.single_path, v.description) for v in VERIFIERS.values()]
        return ReplicaInfo(
            **self.model_info,
            methods=(*methods, MethodInfo(AUTO, False, AUTO_DESCRIPTION)),
            default_method=cfg.default_method,
            default_gamma=cfg.default_gamma,
            default_max_new_tokens=cfg.default_max_new_tokens,
            max_new_tokens=cfg.max_new_tokens,
            max_k=cfg.max_k,
            max_gamma=cfg.max_gamma,
            max_batch=cfg.max_batch,
            max_queued=cfg.max_queued,
        )

    async def stats(self) -> ReplicaStats:
        """Cumulative coordinator counters of this replica (tests, load tests)."""
        s = self.coordinator.stats
        engine = self.coordinator.engine
        # Read before the counters: the coordinator counts a job before it drops it, so an
        # idle reading comes with every count it led to.
        in_flight, active = self.coordinator.in_flight, len(engine.active)
        return ReplicaStats(
            replica=self.id,
            pid=os.getpid(),
            steps=s.steps,
            batch_sizes=dict(s.batch_sizes),
            step_seconds={name: getattr(s.times, name) for name in StepTimes.PHASES},
            finished=s.finished,
            cancelled=s.cancelled,
            rejected=s.rejected,
            recoveries=s.recoveries,
            in_flight=in_flight,
            active=active,
            parked_sessions=list(engine.parking.entries),
        )

    async def worker_pids(self) -> dict[str, list[int]]:
        """Process ids of this replica's draft actor and target shards (fault injection)."""
        engine = self.coordinator.engine

        async def pids(actors) -> list[int]:
            return list(await asyncio.gather(*[a.__ray_call__.remote(_pid) for a in actors]))

        return dict(draft=await pids(engine.draft.actors), target=await pids(engine.target.actors))

    def check_health(self) -> None:
        """Serve calls this periodically; raising makes Serve replace the replica."""
        if not self.coordinator.healthy():
            raise RuntimeError(f"coordinator failed: {self.coordinator.failure!r}")

    def __del__(self) -> None:
        """Serve calls this when it stops the replica (scale-down, redeploy, shutdown)."""
        import ray

        coordinator = getattr(self, "coordinator", None)
        if coordinator is None:
            return
        coordinator.close()
        engine = coordinator.engine
        for actor in engine.draft.actors + engine.target.actors:
            ray.kill(actor)
        # A replica is a detached actor: the placement group would outlive it otherwise.
        ray.util.remove_placement_group(engine.target.placement_group)
