"""The models as Ray actors: one draft actor and a group of tensor-parallel target shard actors.

`RemoteDraft` and `RemoteTarget` give the coordinator the same interface as the in-process
`DraftWorker` / `TargetWorker`, so `service.engine.SpeculativeEngine` runs unchanged over Ray.

Calls that return nothing (prefill, move, commit) are sent without waiting: Ray runs one caller's
calls on an actor in submission order, so the next call that waits (propose, score) also waits
for them, and any error they raised is raised there. Each actor reports the seconds it computed;
what a waiting call took beyond that is *transfer* (serialization, object store, scheduling),
kept in `transfer_s` for the engine's step-time breakdown.

The target shards live in one STRICT_PACK placement group (tensor parallelism wants one node);
their torch.distributed group rendezvouses on rank 0's loopback store.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from workers.draft import DraftWorker
from workers.models import DTYPES, load_model
from workers.sampling import SamplingParams
from workers.target import path_rows
from workers.tensor_parallel import TargetShard, join_group, loopback_store
from workers.tree import DraftTree

DRAFT_OPS = ("prefill", "move", "propose_with_state", "commit")


def _actor_device(device: str) -> str:
    # Ray gives each GPU actor exactly one visible GPU: always cuda:0 inside the actor.
    return "cuda:0" if torch.device(device).type == "cuda" else device


@ray.remote
class DraftActor:
    def __init__(self, path: str, slots: int, max_len: int, dtype: str, device: str, threads: int):
        torch.set_num_threads(threads)
        device = _actor_device(device)
        model = load_model(path, dtype, device).build()
        self.worker = DraftWorker(model, slots, max_len, DTYPES[dtype], device)

    def ready(self) -> None:
        """Returns once the constructor (model load) has run; raises what it raised."""

    def call(self, op: str, args: tuple) -> tuple[Any, float]:
        if op not in DRAFT_OPS:  # ops come from RemoteDraft only: a wrong one is our bug
            raise RuntimeError(f"unknown draft op {op!r}; expected one of {DRAFT_OPS}")
        fn = self.propose_with_state if op == "propose_with_state" else getattr(self.worker, op)
        start = time.perf_counter()
        out = fn(*args)
        return out, time.perf_counter() - start

    def propose_with_state(self, pending, pending_count, paths, depths, params, states):
        """DraftWorker.propose with generators rebuilt from, and returned as, their states."""
        generators = [torch.Generator().set_state(state) for state in states]
        x, q = self.worker.propose(pending, pending_count, paths, depths, params, generators)
        return x, q, [g.get_state() for g in generators]


@ray.remote
class TargetShardActor:
    def __init__(
        self,
        path: str,
        rank: int,
        world: int,
        slots: int,
        max_len: int,
        dtype: str,
        device: str,
        threads: int,
    ):
        torch.set_num_threads(threads)
        self.device = _actor_device(device)
        self.shard = TargetShard(path, rank, world, slots, max_len, dtype, self.device)
        self._store = None

    def ready(self) -> None:
        """Returns once the constructor (shard load) has run; raises what it raised."""

    def open_store(self, timeout_s: float) -> int:
        """Rank 0: the group's rendezvous store on 127.0.0.1; returns its port."""
        self._store = loopback_store(self.shard.world, timeout_s)
        return self._store.port

    def join(self, port: int, timeout_s: float) -> None:
        join_group(self.shard.rank, self.shard.world, port, self.device, timeout_s, self._store)

    def call(self, op: str, args: tuple) -> tuple[Any, float]:
        start = time.perf_counter()
        out = self.shard.execute(op, args)
        # Every rank computes full logits (lm_head is replicated); only rank 0's travel back.
        return (out if self.shard.rank == 0 else None), time.perf_counter() - start


class _Remote:
    """Pipelined calls to one or more actors that run the same ops in lockstep."""

    def __init__(self, actors: list):
        self.actors = actors
        self._unwaited: list[ray.ObjectRef] = []
        self.transfer_s = 0.0

    def _send(self, op: str, *args) -> list[ray.ObjectRef]:
        payload = ray.put(args) if len(self.actors) > 1 else args  # serialized once for all
        return [a.call.remote(op, payload) for a in self.actors]

    def _post(self, op: str, *args) -> None:
        self._unwaited += self._send(op, *args)

    def _wait(self, op: str, *args) -> Any:
        start = time.perf_counter()
        refs = self._send(op, *args)
        earlier, self._unwaited = self._unwaited, []
        ray.get(earlier)  # raises what an unwaited call raised
        results = ray.get(refs)
        wall = time.perf_counter() - start
        self.transfer_s += max(wall - max(seconds for _, seconds in results), 0.0)
        return results[0][0]

    def pop_transfer_s(self) -> float:
        seconds, self.transfer_s = self.transfer_s, 0.0
        return seconds

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Wait until every actor has loaded its model (raises a load failure)."""
        ray.get([a.ready.remote() for a in self.actors], timeout=timeout_s)

    def prefill(
        self, slot0: int, contexts: list[torch.Tensor], keep: list[int] | None = None
    ) -> None:
        self._post("prefill", slot0, contexts, keep)

    def move(self, src: int, dst: int) -> None:
        self._post("move", src, dst)

    def commit(self, path: torch.Tensor, num_accepted: torch.Tensor) -> None:
        self._post("commit", path, num_accepted)


class RemoteDraft(_Remote):
    def propose(
        self,
        pending: torch.Tensor,  # [n, P] int64
        pending_count: torch.Tensor,  # [n] int64
        paths: list[int],  # per request: its K (0: plain)
        depths: list[int],  # per request: its γ (0: plain)
        params: list[SamplingParams],
        generators: list[torch.Generator],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft tokens [n, K, γ] and processed rows [n, K, γ, V] (see DraftWorker.propose).

        The generators travel to the actor and back: the request's randomness stays a single
        stream whichever process draws from it."""
        states = [g.get_state() for g in generators]
        x, q, states = self._wait(
            "propose_with_state", pending, pending_count, paths, depths, params, states
        )
        for g, state in zip(generators, states, strict=True):
            g.set_state(state)
        return x, q


class RemoteTarget(_Remote):
    def score(self, tree: DraftTree, params: list[SamplingParams]) -> torch.Tensor:
        """Processed target rows [n, K, γ+1, V]; the coordinator processes rank 0's logits."""
        return path_rows(self._wait("score_logits", tree), tree, params)


@dataclass(frozen=True)
class ActorSpec:
    """How to start the actors of one model: where it is and what each actor gets."""

    path: str  # model directory
    dtype: str  # a key of workers.models.DTYPES
    device: str  # "cpu" or "cuda" (each actor sees its own GPU as cuda:0)
    threads: int  # intra-op torch threads per actor
    num_cpus: float  # Ray resources per actor
    num_gpus: float


def start_draft(spec: ActorSpec, slots: int, max_len: int) -> RemoteDraft:
    actor = DraftActor.options(num_cpus=spec.num_cpus, num_gpus=spec.num_gpus).remote(
        spec.path, slots, max_len, spec.dtype, spec.device, spec.threads
    )
    return RemoteDraft([actor])


def start_target(
    spec: ActorSpec, world: int, slots: int, max_len: int, timeout_s: float = 300.0
) -> RemoteTarget:
    """The target split over `world` shard actors (spec's resources each) in one placement
    group."""
    bundle = {"CPU": spec.num_cpus}
    if spec.num_gpus:
        bundle["GPU"] = spec.num_gpus
    group = placement_group([bundle] * world, strategy="STRICT_PACK")
    ray.get(group.ready(), timeout=timeout_s)
    actors = [
        TargetShardActor.options(
            num_cpus=spec.num_cpus,
            num_gpus=spec.num_gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, rank),
        ).remote(spec.path, rank, world, slots, max_len, spec.dtype, spec.device, spec.threads)
        for rank in range(world)
    ]
    try:
        if world > 1:
            port = ray.get(actors[0].open_store.remote(timeout_s), timeout=timeout_s)
            ray.get([a.join.remote(port, timeout_s) for a in actors], timeout=timeout_s)
        else:
            ray.get(actors[0].ready.remote(), timeout=timeout_s)
    except BaseException:
        for a in actors:
            ray.kill(a)
        remove_placement_group(group)
        raise
    target = RemoteTarget(actors)
    target.placement_group = group
    return target
