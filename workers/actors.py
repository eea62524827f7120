"""The models as Ray actors: one draft actor and a group of tensor-parallel target shard actors.

`RemoteDraft` and `RemoteTarget` give the coordinator the worker interface the engine needs
(workers/protocols.py: a `Draft` and a `Target`: prefill, move, commit) plus one chained call
per decode step, `RemoteTarget.speculate`, which the engine's Ray step executor makes:

    coordinator --(pending tokens, draft keys)---------> draft actor: propose
    draft actor --(draft tokens, rows q)---------------> target shards: tree, forward
    coordinator --(generator states)-------------------> target rank 0: verification (the
                                                          engine's function, sent with the call)
    target rank 0 --(emitted tokens, τ, path, states, carry)--> coordinator

Each tensor moves once, from the actor that makes it to the one that reads it: the draft's rows
q ([n, K, γ, V], the largest payload) go as a numpy array, through the shared-memory object
store when large (zero-copy on one node), never through the coordinator; the target's rows p
never leave rank 0. With a feature draft, the target's features of a prefill go from rank 0 to
the draft actor by reference; only the pending tokens' come back (`prefill_features`). The
coordinator still drives the step and owns every request's state: its tokens, its verifier's
generator (its state travels with the call to rank 0 and comes back) and its carry. The draft
needs no generator state: its uniforms are a hash of the request's draft key and the step's
root position (workers/sampling.py), which travel as one [n, 2] tensor.

Calls that return nothing (prefill, move, commit) are sent without waiting: Ray runs one caller's
calls on an actor in submission order, so the next call that waits also waits for them, and any
error they raised is raised there. Each actor reports the seconds it computed; what the step's
call took beyond that is *transfer* (serialization, object store, scheduling) in the engine's
step-time breakdown.

The target shards live in one STRICT_PACK placement group (tensor parallelism wants one node);
their torch.distributed group rendezvouses on rank 0's loopback store.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import torch
import torch.distributed as dist
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from workers.draft import padding_groups
from workers.feature_draft import split_groups
from workers.graphs import graphs_available
from workers.models import DTYPES, load_model
from workers.proposers import build_proposer
from workers.protocols import DraftFeed, DraftPrefill
from workers.sampling import SamplingParams
from workers.speculation import Drafting, speculation_cache
from workers.target import path_rows
from workers.tensor_parallel import TargetShard, join_group, loopback_store
from workers.tree import build_tree

DRAFT_OPS = ("prefill", "move", "commit")
# Draft rows larger than this go through the object store (one copy in, zero-copy reads on the
# same node); smaller ones travel inline with the call's reply. Inline is faster for small
# payloads and the store for large ones; the crossover lies between 128 KiB and 1 MiB
# (docs/service_benchmark.md).
STORE_BYTES = 256 << 10


def _tensor_to_wire(t: torch.Tensor) -> tuple[Any, str]:
    """How Ray sends a torch.Tensor between our processes: as a numpy array (bf16 as its int16
    bits), arriving on the CPU. Torch's own pickling goes through torch.save, ~50 µs a tensor
    each way: a step moves dozens of small tensors (tokens, counts, generator states, verdicts);
    numpy takes ~10 µs."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy(), "bfloat16"
    return t.numpy(), ""


def _tensor_from_wire(payload: tuple[Any, str]) -> torch.Tensor:
    array, dtype = payload
    t = torch.from_numpy(np.array(array))  # a writable copy, as torch's own unpickling gives
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


def use_numpy_wire() -> None:
    """Register the serializer above in this process (Ray's serializers are per process; the
    receiving side needs nothing, the deserializer travels by reference)."""
    ray.util.register_serializer(
        torch.Tensor, serializer=_tensor_to_wire, deserializer=_tensor_from_wire
    )


def _actor_device(device: str) -> str:
    # Ray gives each GPU actor exactly one visible GPU: always cuda:0 inside the actor.
    return "cuda:0" if torch.device(device).type == "cuda" else device


# STEP_CALLS: the methods called on every decode step (propose, speculate, and the posted
# prefill/move/commit ops) record no Ray task events. The GCS keeps up to 100,000 of them by
# default, and at tens of calls a second they were its whole growth over a soak
# (docs/reliability.md). Loading, readiness and restart calls keep theirs.


@ray.remote
class DraftActor:
    def __init__(
        self,
        path: str,
        slots: int,
        max_len: int,
        dtype: str,
        device: str,
        threads: int,
        speculation: tuple = (0,),  # fan-out (0: no cache), downweight, max batch
        cuda_graphs: bool = True,
    ):
        use_numpy_wire()
        torch.set_num_threads(threads)
        device = _actor_device(device)
        model = load_model(path, dtype, device).build()
        self.worker = build_proposer(model, slots, max_len, DTYPES[dtype], device)
        if cuda_graphs and graphs_available(device):  # decode forwards replayed (graphs.py)
            self.worker.use_graphs()
        # The speculation cache lives here, beside the draft state it forks and adopts: the
        # coordinator sends each step's request ids and emitted prefixes (the lookup keys)
        self.speculation = speculation_cache(self.worker, *speculation)
        self._last: tuple | None = None  # (drafting, x, q) of the last proposal: `prepare`

    def ready(self) -> None:
        """Returns once the constructor (model load) has run; raises what it raised."""

    @ray.method(enable_task_events=False)  # per step: see STEP_CALLS
    def call(self, op: str, args: tuple) -> tuple[Any, float]:
        if op not in DRAFT_OPS:  # ops come from RemoteDraft only: a wrong one is our bug
            raise RuntimeError(f"unknown draft op {op!r}; expected one of {DRAFT_OPS}")
        start = time.perf_counter()
        # Another actor's output passed by reference (the target's prefill features: see
        # RemoteTarget.prefill_features) is fetched here, not through the coordinator.
        args = tuple(ray.get(a) if isinstance(a, ray.ObjectRef) else a for a in args)
        out = getattr(self.worker, op)(*args)
        return out, time.perf_counter() - start

    def head_vocab(self) -> torch.Tensor | None:
        """[Vh] int64: the ids the draft's head keeps (q is zero elsewhere); None: all."""
        return self.worker.model.head_vocab

    def feed(self) -> DraftFeed:
        """The proposer's host side, which the coordinator runs (it holds no state)."""
        return self.worker.feed

    @ray.method(enable_task_events=False)  # per step: see STEP_CALLS
    def propose(
        self, pending, pending_count, paths, depths, draws, features, own, keys, params
    ) -> Drafted:
        """The proposer's propose (draws: [n, 2] draft keys and root positions; keys: the
        requests' ids and last emitted prefixes, what the speculation cache looks up)."""
        start = time.perf_counter()
        if self.speculation is not None:
            pending = pending.to(self.worker.device, non_blocking=True)
            drafting = Drafting(
                *keys, pending, pending_count, paths, depths, params, draws, features, own
            )
            x, q = self.speculation.propose(self.worker, drafting)
            self._last = (drafting, x, q)
            head = self.worker.model.head_vocab  # q goes on the head's ids, as below
            q = q if head is None else q.index_select(-1, head)
        else:
            x, q = self.worker.propose(  # q on the head's ids only: rank 0 widens it
                pending, pending_count, paths, depths, params, draws, features,
                whole_vocab=False, own=own,
            )  # fmt: skip
        rows = q.cpu().numpy()  # numpy: zero-copy through the object store, unlike torch
        rows = ray.put(rows) if rows.nbytes > STORE_BYTES else rows
        return Drafted(x.cpu(), rows, time.perf_counter() - start)

    def speculation_stats(self) -> dict[str, int]:
        """The speculation cache's counters (workers/speculation.py); empty without one."""
        cache = self.speculation
        if cache is None:
            return {}
        return dict(hits=cache.hits, lookups=cache.lookups, prepared=cache.prepared)

    @ray.method(enable_task_events=False)  # per step: see STEP_CALLS
    def prepare(self) -> tuple[None, float]:
        """Prepare the next step's proposals for the last proposal's likeliest outcomes
        (workers/speculation.py). Posted right after `propose`, so it runs here while the
        target shards score and verify that proposal; the engine's commit comes after it."""
        start = time.perf_counter()
        if self._last is not None:
            self.speculation.prepare(self.worker, *self._last)
            self._last = None
        return None, time.perf_counter() - start


@dataclass
class Drafted:
    """A draft actor's proposal, on its way to the target shards."""

    tokens: torch.Tensor  # [n, K, γ] int64
    rows: np.ndarray | ray.ObjectRef  # [n, K, γ, Vh] float32: q on the draft head's ids
    seconds: float  # the draft actor's compute


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
        cuda_graphs: bool = True,
    ):
        use_numpy_wire()
        torch.set_num_threads(threads)
        self.device = _actor_device(device)
        self.shard = TargetShard(path, rank, world, slots, max_len, dtype, self.device, cuda_graphs)
        self._store = None
        self._draft_vocab: torch.Tensor | None = None  # [Vh]: see use_draft
        self._send_features = False  # see use_draft

    def ready(self) -> None:
        """Returns once the constructor (shard load) has run; raises what it raised."""

    def open_store(self, timeout_s: float) -> int:
        """Rank 0: the group's rendezvous store on 127.0.0.1; returns its port."""
        self._store = loopback_store(self.shard.world, timeout_s)
        return self._store.port

    def join(self, port: int, timeout_s: float) -> None:
        join_group(self.shard.rank, self.shard.world, port, self.device, timeout_s, self._store)

    @ray.method(enable_task_events=False)  # per step: see STEP_CALLS
    def call(self, op: str, args: tuple) -> tuple[None, float]:
        """Runs a TargetWorker op; its output stays here (prefill's features go to a feature
        draft by prefill_features)."""
        start = time.perf_counter()
        self.shard.execute(op, args)
        return None, time.perf_counter() - start

    @ray.method(num_returns="streaming", enable_task_events=False)  # as prefill: STEP_CALLS
    def prefill_features(
        self,
        args: tuple,  # TargetWorker.prefill's (slot0, contexts, keep)
        draft_keep: list[int],
        draft_pending: list[int],
    ) -> Iterator[list[torch.Tensor]]:
        """Rank 0, feature draft: prefill one padding group at a time. Yields, per group, what
        the draft's prefill reads of it (workers.feature_draft.split_groups; it goes to the
        draft actor by reference), then the pending tokens' features, for the coordinator."""
        tails = []
        groups = self.shard.worker.prefill_groups(*args)
        for _, _, inputs, pending in split_groups(groups, draft_keep, draft_pending):
            tails += pending
            yield inputs
        yield tails

    def use_draft(self, head_vocab: torch.Tensor | None, reads_features: bool) -> None:
        """The ids the draft's rows arrive on ([Vh] int64; None: the whole vocabulary), and
        whether it reads the target's features (rank 0 then returns those of what it commits)."""
        self._draft_vocab = None if head_vocab is None else head_vocab.to(self.device)
        self._send_features = reads_features

    @ray.method(enable_task_events=False)  # per step: see STEP_CALLS
    @torch.inference_mode()
    def speculate(
        self,
        roots: torch.Tensor,  # [n] int64
        num_paths: list[int],  # [n]
        depth: list[int],  # [n]
        params: list[SamplingParams],
        drafted: Drafted | None,  # None: nothing drafted (a batch of plain requests)
        states: list[torch.Tensor] | None,  # rank 0: the verifier generators' states
        verify: Callable | None,  # rank 0: (x, q, p, generators) -> verdict; others: None
    ) -> tuple[torch.Tensor, Any, list[torch.Tensor], dict[str, float]] | None:
        """Score the step's trees on every rank; on rank 0 verify, then every rank commits.

        Rank 0 returns (draft tokens [n, K, γ], the verdict, the generators' states, seconds
        per phase); the verdict has `path` and `num_accepted` ([n] int64) to commit, and the
        kept positions' `features` when a feature draft reads them."""
        laps = {"draft": drafted.seconds if drafted else 0.0}
        dev, n = self.device, roots.shape[0]
        start = time.perf_counter()
        # Arrived on the host (the wire): copied to the device without waiting for it.
        x_host = drafted.tokens if drafted else torch.zeros(n, 1, 1, dtype=torch.int64)
        x = x_host.to(dev, non_blocking=True)
        paths, depths = (torch.tensor(v).to(dev, non_blocking=True) for v in (num_paths, depth))
        tree = build_tree(roots.to(dev, non_blocking=True), x, paths, depths)
        laps["tree"] = time.perf_counter() - start
        start = time.perf_counter()
        logits = self.shard.execute("score_logits", (tree,))  # [n, N, V], full on every rank
        rank0 = self.shard.rank == 0
        p = path_rows(logits, tree, params) if rank0 else None  # [n, K, γ+1, V]
        laps["target"] = time.perf_counter() - start
        accepted = torch.zeros(2, n, dtype=torch.int64, device=dev)  # path, τ
        if rank0:
            q = self._draft_rows(drafted, p)  # fetching it is transfer, not a phase
            start = time.perf_counter()
            generators = [torch.Generator().set_state(s) for s in states]
            verdict = verify(x, q, p, generators)  # path and τ on the host (verify_on_host)
            kept = torch.stack([verdict.path, verdict.num_accepted])
            accepted = kept.to(dev, non_blocking=True)
            laps["verify"] = time.perf_counter() - start
        if self.shard.world > 1:  # the other ranks learn what to keep from rank 0
            dist.broadcast(accepted, src=0)
        start = time.perf_counter()
        # Rank 0 commits its host copy (its cache then keeps its lengths on the host).
        features = self.shard.execute("commit", tuple(kept if rank0 else accepted))
        if not rank0:
            return None
        if self._send_features:
            verdict.features = features.cpu()
        laps["target"] += time.perf_counter() - start
        return x_host, verdict, [g.get_state() for g in generators], laps

    def _draft_rows(self, drafted: Drafted | None, p: torch.Tensor) -> torch.Tensor | None:
        """The draft's rows q on the whole vocabulary [n, K, γ, V], on p's device."""
        if drafted is None:
            return None
        rows = drafted.rows
        if isinstance(rows, ray.ObjectRef):
            rows = ray.get(rows)
        with warnings.catch_warnings():  # a store object is read-only; q is only read
            warnings.simplefilter("ignore", UserWarning)
            q = torch.from_numpy(rows).to(p.device, non_blocking=True)
        if self._draft_vocab is None:
            return q
        full = q.new_zeros(*q.shape[:-1], p.shape[-1])
        return full.index_copy_(-1, self._draft_vocab, q)


class WorkerLost(RuntimeError):
    """An actor of the step died (its process was killed, its node lost). The proxies can
    `restart` their actors; the caches are gone with them (the engine rebuilds them)."""


class _Remote:
    """Pipelined calls to one or more actors that run the same ops in lockstep."""

    # A step's calls not done after this long are stuck: the step's actors are restarted
    # (None: wait forever). A replica sets its ReplicaConfig.step_timeout_s.
    step_timeout_s: float | None = None

    def __init__(self, launch: Callable[[], list]):
        use_numpy_wire()
        self._launch = launch  # starts the actors
        self.actors = launch()
        self._unwaited: list[ray.ObjectRef] = []

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Wait until every actor has loaded its model (raises a load failure)."""
        ray.get([a.ready.remote() for a in self.actors], timeout=timeout_s)

    def alive(self, timeout_s: float = 10.0) -> bool:
        """Whether every actor of the group answers (between steps: they are idle)."""
        try:
            self.wait_ready(timeout_s)
            return True
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False

    def restart(self) -> None:
        """Replace every actor of the group with a fresh one: models reloaded, caches empty
        (`wait_ready` waits for the load)."""
        for actor in self.actors:
            ray.kill(actor)  # a survivor of a tensor-parallel group cannot rejoin a new one
        self._unwaited = []
        self.actors = self._launch()

    def _post(self, op: str, *args) -> list[ray.ObjectRef]:
        payload = ray.put(args) if len(self.actors) > 1 else args  # serialized once for all
        refs = [a.call.remote(op, payload) for a in self.actors]
        self._unwaited += refs
        return refs

    def _check_posted(self) -> float:
        """Raise what an unwaited call raised (they have run once a later call returned);
        returns the seconds they computed (per actor of a lockstep group: the mean)."""
        earlier, self._unwaited = self._unwaited, []
        seconds = [s for _, s in _gather(earlier, self.step_timeout_s)]
        return sum(seconds) / len(self.actors)

    @property
    def device(self) -> torch.device:
        """Where the engine leaves the inputs: on the host, for the wire (each actor moves
        what it gets)."""
        return torch.device("cpu")

    def move(self, src: int, dst: int) -> None:
        self._post("move", src, dst)


class RemoteDraft(_Remote):
    """The draft actor's proxy (a `Draft`: workers/protocols.py)."""

    def prefill(
        self,
        slot0: int,
        contexts: list[torch.Tensor],
        keep: list[int] | None = None,
        features: list[torch.Tensor] | None = None,
    ) -> None:
        self._post("prefill", slot0, contexts, keep, features)

    def commit(self, path: torch.Tensor, keep: torch.Tensor) -> None:
        self._post("commit", path, keep)

    def __init__(self, launch: Callable[[], list], speculating: bool = False):
        super().__init__(launch)
        self.speculating = speculating  # the actor keeps a speculation cache

    def propose(self, *args) -> ray.ObjectRef:
        """Start DraftActor.propose; the result (a `Drafted`) goes straight to the target.
        With a speculation cache, its `prepare` is posted next: the draft works while the
        target verifies."""
        drafted = self.actors[0].propose.remote(*args)
        if self.speculating:
            self._unwaited.append(self.actors[0].prepare.remote())
        return drafted

    def speculation_stats(self) -> dict[str, int]:
        """The actor's speculation cache counters: hits, lookups, prepared ({}: no cache)."""
        return ray.get(self.actors[0].speculation_stats.remote())

    @functools.cached_property
    def feed(self) -> DraftFeed:
        """The actor's proposer's feed (the same model after a restart)."""
        return ray.get(self.actors[0].feed.remote())


class RemoteTarget(_Remote):
    """The target shard actors' proxy (a `Target`: workers/protocols.py)."""

    _draft_vocab: torch.Tensor | None = None  # [Vh]: the draft head's ids (None: all)
    _send_features = False  # the draft reads the target's features

    def use_draft(self, draft: RemoteDraft) -> None:
        """Tell rank 0 which ids the draft's rows arrive on and whether the draft reads the
        target's features (at start and after a restart)."""
        self._draft_vocab = ray.get(draft.actors[0].head_vocab.remote())
        self._send_features = draft.feed.reads_features
        ray.get(self.actors[0].use_draft.remote(self._draft_vocab, self._send_features))

    def restart(self) -> None:
        super().restart()
        # runs before any step
        self.actors[0].use_draft.remote(self._draft_vocab, self._send_features)

    def prefill(
        self, slot0: int, contexts: list[torch.Tensor], keep: list[int] | None = None
    ) -> None:
        """Posted without waiting."""
        self._post("prefill", slot0, contexts, keep)

    def prefill_features(
        self,
        slot0: int,
        contexts: list[torch.Tensor],
        keep: list[int],
        draft_keep: list[int],
        draft_pending: list[int],
        to_draft: DraftPrefill,  # gets a reference to each group's draft inputs
    ) -> list[torch.Tensor]:
        """Prefill for a feature draft. Rank 0 prefills one padding group at a time
        (workers.draft.padding_groups of the contexts' lengths, in order); as each is done,
        to_draft(lo, hi, ref) gets a reference to what the draft's prefill reads of contexts
        lo..hi, so that the draft prefills it while rank 0 runs the next group, and the
        features go from rank 0 to the draft actor, not through here. Returns the pending
        tokens' features [pending_i, E], which the requests' next step sends.

        Waits for every call posted so far: the caller's wall time counts them (the step's
        `prefill`), not the next step's posted-compute seconds, so they count once."""
        args = (slot0, contexts, keep)
        payload = ray.put(args) if len(self.actors) > 1 else args  # serialized once for all
        stream = self.actors[0].prefill_features.remote(payload, draft_keep, draft_pending)
        self._unwaited += [a.call.remote("prefill", payload) for a in self.actors[1:]]
        try:
            for lo, hi in padding_groups([len(c) for c in contexts]):  # rank 0's groups
                to_draft(lo, hi, next(stream))
            tails = ray.get(next(stream))
            self._check_posted()
            return tails
        except ray.exceptions.RayActorError as exc:
            raise WorkerLost(str(exc)) from exc

    def speculate(
        self,
        draft: RemoteDraft,
        draft_args: tuple | None,  # (pending [n, P], pending_count [n], paths, depths, draws
        # [n, 2], pending_features [n, P, E] or None, own_features [n] or None, (request ids,
        # last emitted prefixes)) or None: no drafting
        roots: torch.Tensor,  # [n] int64
        num_paths: list[int],
        depth: list[int],
        params: list[SamplingParams],
        generators: list[torch.Generator],
        verify: Callable,  # (x, q, p, generators) -> verdict with .path and .num_accepted
    ) -> tuple[torch.Tensor, Any, dict[str, float]]:
        """One decode step over the actors, waited once: draft → target shards → back.

        Returns (draft tokens [n, K, γ], verify's verdict, seconds per phase with `transfer`:
        the call's wall time beyond the actors' compute). The generators come back advanced."""
        start = time.perf_counter()
        states = [g.get_state() for g in generators]
        drafted = None
        if draft_args is not None:
            drafted = draft.propose(*draft_args, params)
        refs = []
        for rank, actor in enumerate(self.actors):
            own = (states, verify) if rank == 0 else (None, None)  # only rank 0 verifies
            refs.append(actor.speculate.remote(roots, num_paths, depth, params, drafted, *own))
        try:
            posted = draft._check_posted() + self._check_posted()  # prefills, moves, commits
            x, verdict, states, seconds = _gather(refs, self.step_timeout_s)[0]
        except ray.exceptions.RayActorError as exc:  # the generators were left as they were
            raise WorkerLost(str(exc)) from exc
        except StepTimedOut as exc:  # which actor is stuck is unknown: restart them all
            for actor in draft.actors + self.actors:
                ray.kill(actor)
            raise WorkerLost(f"the step's actors did not answer: {exc}") from exc
        except ray.exceptions.RayTaskError as exc:  # a shard's collective broke: a peer died?
            if draft.alive() and self.alive():
                raise  # the step itself failed
            raise WorkerLost(f"a peer of a failed call died: {exc}") from exc
        seconds["prefill"] = posted
        for g, state in zip(generators, states, strict=True):
            g.set_state(state)
        wall = time.perf_counter() - start
        seconds["transfer"] = max(wall - sum(seconds.values()), 0.0)
        return x, verdict, seconds


@dataclass(frozen=True)
class ActorSpec:
    """How to start the actors of one model: where it is and what each actor gets."""

    path: str  # model directory
    dtype: str  # a key of workers.models.DTYPES
    device: str  # "cpu" or "cuda" (each actor sees its own GPU as cuda:0)
    threads: int  # intra-op torch threads per actor
    num_cpus: float  # Ray resources per actor
    num_gpus: float
    resources: dict[str, float] = field(default_factory=dict)  # custom ones: where it may run
    cuda_graphs: bool = True  # on CUDA: decode forwards replayed (workers/graphs.py)


class StepTimedOut(TimeoutError):
    """Calls of a step that did not finish in time: an actor is alive but stuck (a hung
    process, a collective whose peer never came)."""


def _gather(refs: list[ray.ObjectRef], timeout_s: float | None = None) -> list:
    """ray.get, but a failed call raises at once: when one shard of a tensor-parallel group
    dies, its peers wait in a collective that would never finish. Raises StepTimedOut when the
    calls are not all done within `timeout_s` (None: no bound). One call (a whole target's
    step) is one ray.get, as before the bound."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def left() -> float | None:
        return None if deadline is None else max(deadline - time.monotonic(), 0.0)

    pending = list(refs)
    try:
        while len(pending) > 1:
            ready, pending = ray.wait(pending, num_returns=1, timeout=left())
            if not ready:
                raise ray.exceptions.GetTimeoutError()
            ray.get(ready)
        return ray.get(refs, timeout=left())
    except ray.exceptions.GetTimeoutError:
        message = f"{len(pending)} of {len(refs)} calls not done in {timeout_s} s"
        raise StepTimedOut(message) from None


def start_draft(
    spec: ActorSpec, slots: int, max_len: int, speculation: tuple = (0,)
) -> RemoteDraft:
    """The draft actor, loading (`wait_ready` waits for it); `speculation`: its speculation
    cache's fan-out (0: none), downweight and max batch (workers/speculation.py)."""

    def launch() -> list:
        options = dict(num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, resources=spec.resources)
        args = (spec.path, slots, max_len, spec.dtype, spec.device, spec.threads, speculation)
        return [DraftActor.options(**options).remote(*args, cuda_graphs=spec.cuda_graphs)]

    return RemoteDraft(launch, speculating=speculation[0] > 0)


def start_target(
    spec: ActorSpec, world: int, slots: int, max_len: int, timeout_s: float = 300.0
) -> RemoteTarget:
    """The target split over `world` shard actors (spec's resources each) in one placement
    group (kept for restarts)."""
    bundle = {"CPU": spec.num_cpus, **spec.resources}
    if spec.num_gpus:
        bundle["GPU"] = spec.num_gpus
    group = placement_group([bundle] * world, strategy="STRICT_PACK")
    ray.get(group.ready(), timeout=timeout_s)

    def launch() -> list:
        actors = [
            TargetShardActor.options(
                num_cpus=spec.num_cpus,
                num_gpus=spec.num_gpus,
                resources=spec.resources,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, rank),
            ).remote(
                spec.path,
                rank,
                world,
                slots,
                max_len,
                spec.dtype,
                spec.device,
                spec.threads,
                spec.cuda_graphs,
            )
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
            raise
        return actors

    try:
        target = RemoteTarget(launch)
    except BaseException:
        remove_placement_group(group)
        raise
    target.placement_group = group
    return target
