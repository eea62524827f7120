"""The models as Ray actors: one draft actor and a group of tensor-parallel target shard actors.

`RemoteDraft` and `RemoteTarget` give the coordinator the worker interface the engine needs
(workers/protocols.py: a `Draft` and a `Target`: prefill, move) plus one chained
exchange per decode step, `RemoteTarget.speculate`, which the engine's step executor over Ray
(`RemoteRunner`) makes. The step (workers/step.py) runs split over the actors, each running its
half with its own `StepRunner`:

    coordinator --(the Step)---------------------------> draft actor: propose
    draft actor --(draft tokens, rows q)---------------> target shards: tree, forward
    coordinator --(the Step, less the draft's features)-> target shards; rank 0 verifies
    target rank 0 --(accepted paths: path, τ, live)-----> draft actor: commit
    target rank 0 --(emitted tokens, τ, path, carry)----> coordinator

Ray starts, places and restarts the actors and answers the calls made between steps (loading,
readiness, wiring); the steps' messages go over links wired once (workers/channel.py: one
socket per pair of processes above, ~0.1 ms a hop where a Ray call costs ~0.85 ms). Each actor
serves its links on one thread, in the order the coordinator sent: the coordinator's ops, and
rank 0's step waits for the draft's proposal on its link from the draft. Each tensor moves
once, from the process that makes it to the one that reads it: the draft's rows q
([n, K, γ, Vh], the largest payload) go to rank 0, never through the coordinator (through
shared memory when both are on one node: the link carries where they lie); the target's
rows p never leave rank 0. The coordinator still drives the step and owns every request's state:
its tokens and its carry. No generator state travels: the draft's and the verifier's uniforms
are hashes of the request's keys and the step's root position (workers/sampling.py,
verification.CounterDraws), which travel as [n, 2] tensors.
With a feature draft, rank 0 sends each prefill padding group's draft inputs to the coordinator,
which posts them to the draft (it prefills that group while rank 0 runs the next).

Ops that return nothing (prefill, move) are posted without waiting; an actor reports the
seconds they computed, and the first error one raised, with its next reply. Each reply carries
the seconds its actor computed; what the step took beyond that is *transfer* (serialization,
sockets, waking the processes) in the engine's step-time breakdown.

The target shards live in one STRICT_PACK placement group (tensor parallelism wants one node);
their torch.distributed group rendezvouses on rank 0's loopback store.
"""

from __future__ import annotations

import contextlib
import functools
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from blockspec.workers.channel import (
    LOOPBACK,
    Link,
    LinkBroken,
    SharedReader,
    SharedTensor,
    SharedWriter,
    accept,
    dial,
    dumps,
    listen,
    new_key,
    ready,
    tensor_from_wire,
    tensor_to_wire,
)
from blockspec.workers.compiled import DEFAULT_FORWARDS, DecodeForwards
from blockspec.workers.draft import padding_groups
from blockspec.workers.feature_draft import split_groups
from blockspec.workers.models import DTYPES, LoadedModel, load_model
from blockspec.workers.proposers import build_proposer
from blockspec.workers.protocols import DraftFeed, DraftPrefill
from blockspec.workers.speculation import speculation_cache
from blockspec.workers.step import GraphCounts, Proposal, Step, StepRunner, Verdict
from blockspec.workers.target import path_rows
from blockspec.workers.tensor_parallel import TargetShard, join_group, loopback_store
from blockspec.workers.tree import DraftTree

POSTED_OPS = ("prefill", "move")  # what the coordinator posts to the draft, unanswered


def use_numpy_wire() -> None:
    """Send tensors through Ray's calls as the links do (channel.tensor_to_wire), from this
    process (Ray's serializers are per process; the receiving side needs nothing, the
    deserializer travels by reference)."""
    ray.util.register_serializer(
        torch.Tensor, serializer=tensor_to_wire, deserializer=tensor_from_wire
    )


def _actor_device(device: str) -> str:
    # Ray gives each GPU actor exactly one visible GPU: always cuda:0 inside the actor.
    return "cuda:0" if torch.device(device).type == "cuda" else device


def _portable(exc: BaseException) -> BaseException:
    """exc, or a RuntimeError naming it where it does not pickle (it crosses a link)."""
    try:
        pickle.dumps(exc)
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class _Served:
    """An actor's side of the links: one thread runs what arrives, in order. Posted ops'
    seconds and their first error wait here for the actor's next reply."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._posted = 0.0
        self._failed: BaseException | None = None

    def node(self) -> tuple[str, str]:
        """(node id, node IP): where the coordinator finds this actor's listener."""
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def _open(self, host: str, key: bytes):
        """A fresh listener; the previous wiring's thread has ended (its coordinator closed
        its links first) or is left to end on its own."""
        if self._thread is not None:
            self._thread.join(timeout=10.0)
        self._posted, self._failed = 0.0, None
        return listen(host, key)

    def _start(
        self,
        listener,
        links: dict[str, Link],  # dialled already
        steps: dict[str, Callable[[dict[str, Link], tuple], None]],  # by op: the waited ones
        accepts: tuple[str, ...] = (),  # who else dials in, beside the coordinator
    ) -> None:
        """Serve on a thread of its own: accept the coordinator (and `accepts`), then run what
        the coordinator sends, in order: a step op by `steps`, any other as posted."""

        def serve() -> None:
            try:
                links.update(accept(listener, {"coordinator", *accepts}))
                listener.close()
                while True:
                    op, args = links["coordinator"].recv()
                    if op in steps:
                        steps[op](links, args)
                    else:
                        self._run_posted(op, args)
            except (LinkBroken, OSError):  # the coordinator closed the wiring, or died
                pass
            finally:
                for link in links.values():
                    link.close()

        self._thread = threading.Thread(target=serve, name="blockspec-links", daemon=True)
        self._thread.start()

    def _run_posted(self, op: str, args: tuple) -> None:
        start = time.perf_counter()
        try:
            if self._failed is None:  # after a failure the caches are suspect: the reply fails
                self.call(op, args)
        except Exception as exc:
            self._failed = _portable(exc)
        self._posted += time.perf_counter() - start

    def _take_posted(self) -> tuple[float, BaseException | None]:
        out = (self._posted, self._failed)
        self._posted, self._failed = 0.0, None
        return out

    def call(self, op: str, args: tuple) -> None:
        raise NotImplementedError


@dataclass
class Drafted:
    """A draft actor's proposal, on its way to the target shards (each step has one, empty
    when nothing is drafted: it also brings the draft's posted seconds and failures)."""

    tokens: torch.Tensor | None  # [n, K, γ] int64; None: nothing drafted
    # [n, K, γ, Vh] float32: q on the draft head's ids (rank 0 only); in shared memory when
    # rank 0 shares the draft's node
    rows: torch.Tensor | SharedTensor | None
    seconds: float = 0.0  # the draft actor's compute
    posted: float = 0.0  # seconds of the ops posted to the draft since its last proposal
    error: BaseException | None = None  # a posted op's or the proposal's


@dataclass
class Reply:
    """A target rank's answer to a step (or rank 0's to a feature prefill)."""

    out: Any  # rank 0: (x [n, K, γ], verdict, seconds per phase); else None
    posted: float  # this rank's posted ops' seconds since its last reply
    draft_posted: float = 0.0  # rank 0: the draft's (from its proposal)
    error: BaseException | None = None


@ray.remote
class DraftActor(_Served):
    def __init__(
        self,
        path: str,
        slots: int,
        max_len: int,
        dtype: str,
        device: str,
        threads: int,
        speculation: tuple = (0,),  # fan-out (0: no cache), downweight, max batch
        forwards: DecodeForwards = DEFAULT_FORWARDS,
        weights: LoadedModel | None = None,  # its first actor's (_Remote.weights); None: read
    ):
        super().__init__()
        use_numpy_wire()
        torch.set_num_threads(threads)
        device = _actor_device(device)
        loaded = (weights or load_model(path, dtype, device)).to(device)
        model = loaded.build(packed=forwards.packed)
        self._loaded = None if weights else loaded  # until the proxy takes it (`weights`)
        self.worker = build_proposer(model, slots, max_len, DTYPES[dtype], device)
        forwards.use(self.worker)
        # The step's draft half. The speculation cache lives here, beside the draft state it
        # forks and adopts (the step brings the request ids and emitted prefixes it looks up).
        cache = speculation_cache(self.worker, *speculation)
        self.runner = StepRunner(None, self.worker, cache)
        self._rows = SharedWriter()  # q for a rank 0 on this node
        self._share_rows = False  # set by `wire`

    def ready(self) -> None:
        """Returns once the constructor (model load) has run; raises what it raised."""

    def weights(self) -> LoadedModel:
        """The model's weights, once (then dropped here): what a restart loads."""
        loaded, self._loaded = self._loaded, None
        return loaded

    def head_vocab(self) -> torch.Tensor | None:
        """[Vh] int64: the ids the draft's head keeps (q is zero elsewhere); None: all."""
        return self.worker.model.head_vocab

    def feed(self) -> DraftFeed:
        """The proposer's host side, which the coordinator runs (it holds no state)."""
        return self.worker.feed

    def graphs(self, strict: bool | None, sealed: bool | None) -> list[GraphCounts]:
        """StepExecutor.graphs, for this actor's half of the step."""
        return self.runner.graphs(strict, sealed)

    def speculation_stats(self) -> dict[str, int]:
        """The speculation cache's counters (workers/speculation.py); empty without one."""
        cache = self.runner.speculation
        if cache is None:
            return {}
        return dict(hits=cache.hits, lookups=cache.lookups, prepared=cache.prepared)

    def wire(
        self, host: str, key: bytes, ranks: list[tuple[str, int]], share_rows: bool
    ) -> tuple[str, int]:
        """Dial the target ranks' listeners, listen on host for the coordinator and serve
        (returns the address it dials); share_rows: rank 0 is on this node and reads q from
        shared memory."""
        listener = self._open(host, key)
        self._share_rows = share_rows
        self._rows.close()  # a new rank 0 maps a new segment (a mapped one has no name left)
        to_ranks = [dial(address, key, "draft") for address in ranks]
        steps = {"step": lambda _, args: self._step(to_ranks, *args)}
        self._start(listener, {f"rank {i}": link for i, link in enumerate(to_ranks)}, steps)
        return listener.address

    def _step(self, ranks: list[Link], step: Step) -> None:
        """Propose (nothing when the step drafts nothing) and send it to every rank; then,
        with a speculation cache, prepare the next step's proposals while the ranks score."""
        posted, failed = self._take_posted()
        drafted = Drafted(None, None, 0.0, posted, failed)
        if step.drafted and failed is None:
            try:
                drafted = self.propose(step)
                drafted.posted = posted
                if self._share_rows:  # one copy in, rather than a socket's two and the kernel's
                    drafted.rows = self._rows.put(drafted.rows)
            except Exception as exc:
                drafted.error = _portable(exc)
        ranks[0].send(drafted)
        if len(ranks) > 1:  # the other ranks build the tree: the tokens, not q
            frames = dumps(Drafted(drafted.tokens, None, error=drafted.error))
            for link in ranks[1:]:
                link.send_frames(frames)
        if self.runner.speculating:
            self._run_posted("prepare", ())
        if step.drafted:  # rank 0 says what it verified; the draft keeps its share of it
            accepted = ranks[0].recv()
            if accepted is not None:
                self._run_posted("keep", (step, *accepted))

    def call(self, op: str, args: tuple) -> None:
        if op == "prepare":
            self.runner.prepare()
        elif op == "keep":
            self.runner.keep(*args)
        elif op in POSTED_OPS:
            getattr(self.worker, op)(*args)
        else:  # ops come from RemoteDraft only: a wrong one is our bug
            raise RuntimeError(f"unknown draft op {op!r}; expected one of {POSTED_OPS}")

    def propose(self, step: Step) -> Drafted:
        """The step's proposal, its rows q on the head's ids only (rank 0 widens them)."""
        start = time.perf_counter()
        x, q = self.runner.propose(step, whole_vocab=False)
        return Drafted(x.cpu(), q.cpu(), time.perf_counter() - start)


@ray.remote
class TargetShardActor(_Served):
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
        forwards: DecodeForwards = DEFAULT_FORWARDS,
        weights: LoadedModel | None = None,  # its first actor's (_Remote.weights); None: read
    ):
        super().__init__()
        use_numpy_wire()
        torch.set_num_threads(threads)
        self.device = _actor_device(device)
        self.shard = TargetShard(
            path, rank, world, slots, max_len, dtype, self.device, forwards, weights,
            keep_loaded=rank == 0 and weights is None,  # what the proxy takes (`weights`)
        )  # fmt: skip
        self._store = None
        self._draft_vocab: torch.Tensor | None = None  # [Vh]: see use_draft
        self._send_features = False  # see use_draft
        self._rows = SharedReader()  # a draft on this node's q
        # The step's target half on rank 0 (the other ranks follow it: `_follow`)
        self.runner = StepRunner(_ShardTarget(self.shard)) if rank == 0 else None

    def ready(self) -> None:
        """Returns once the constructor (shard load) has run; raises what it raised."""

    def weights(self) -> LoadedModel:
        """Rank 0: the whole model's weights, once (then dropped here): what a restart loads."""
        loaded, self.shard.loaded = self.shard.loaded, None
        return loaded

    def graphs(self, strict: bool | None, sealed: bool | None) -> list[GraphCounts]:
        """StepExecutor.graphs, for rank 0's half of the step (the other ranks run eagerly)."""
        return [] if self.runner is None else self.runner.graphs(strict, sealed)

    def open_store(self, timeout_s: float) -> int:
        """Rank 0: the group's rendezvous store on 127.0.0.1; returns its port."""
        self._store = loopback_store(self.shard.world, timeout_s)
        return self._store.port

    def join(self, port: int, timeout_s: float) -> None:
        join_group(self.shard.rank, self.shard.world, port, self.device, timeout_s, self._store)

    def use_draft(self, head_vocab: torch.Tensor | None, reads_features: bool) -> None:
        """The ids the draft's rows arrive on ([Vh] int64; None: the whole vocabulary), and
        whether it reads the target's features (rank 0 then returns those of what it commits)."""
        self._draft_vocab = None if head_vocab is None else head_vocab.to(self.device)
        self._send_features = reads_features

    def wire(self, host: str, key: bytes) -> tuple[str, int]:
        """Listen on host for the coordinator and the draft actor, and serve (returns the
        address they dial)."""
        listener = self._open(host, key)
        steps = {
            "step": lambda links, args: self._step(*args, links),
            "prefill_features": lambda links, args: self._prefill_features(
                links["coordinator"], *args
            ),
        }
        self._start(listener, {}, steps, accepts=("draft",))
        return listener.address

    def call(self, op: str, args: tuple) -> None:
        """Runs a TargetWorker op; its output stays here."""
        self.shard.execute(op, args)

    def _step(self, step: Step, links: dict[str, Link]) -> None:
        """Rank 0 first tells a draft that drafted what it verified (None: nothing to keep), so
        the draft commits while the coordinator reads the reply; then every rank replies."""
        reply = self._reply(step, links["draft"])
        if self.runner is not None and step.drafted:
            accepted = None
            if reply.error is None:
                _, verdict, _ = reply.out
                accepted = (verdict.path, verdict.num_accepted, verdict.live)
            with contextlib.suppress(LinkBroken):  # a dead draft: the coordinator hears it
                links["draft"].send(accepted)
        links["coordinator"].send(reply)

    def _reply(self, step: Step, draft: Link) -> Reply:
        try:  # the draft's proposal comes whether it drafted or not
            drafted = draft.recv()
        except LinkBroken as exc:
            return Reply(None, 0.0, error=LinkBroken(f"the draft actor's link: {exc}"))
        posted, failed = self._take_posted()
        reply = Reply(None, posted, drafted.posted, failed or drafted.error)
        if reply.error is None:
            try:
                reply.out = self.speculate(step, drafted if drafted.tokens is not None else None)
            except Exception as exc:
                reply.error = _portable(exc)
        return reply

    def _prefill_features(self, coordinator: Link, args, draft_keep, draft_pending) -> None:
        """Rank 0, feature draft: prefill one padding group at a time, sending each group's
        draft inputs as it is done (workers.feature_draft.split_groups), then a Reply whose
        out is the pending tokens' features."""
        posted, failed = self._take_posted()
        reply = Reply(None, posted, error=failed)
        if failed is None:
            try:
                tails = []
                groups = self.shard.worker.prefill_groups(*args)
                for _, _, inputs, pending in split_groups(groups, draft_keep, draft_pending):
                    tails += pending
                    coordinator.send(inputs)
                reply.out = tails
            except Exception as exc:
                reply.error = _portable(exc)
        coordinator.send(reply)

    @torch.inference_mode()
    def speculate(
        self,
        step: Step,
        drafted: Drafted | None,  # None: nothing drafted (a plain batch)
    ) -> tuple[torch.Tensor, Verdict, dict[str, float]] | None:
        """Rank 0 runs the step's target half (its StepRunner: tree, score, verify, commit)
        and returns (draft tokens [n, K, γ], the verdict, seconds per phase); the verdict has
        the kept positions' `features` when a feature draft reads them. The other ranks
        follow it."""
        if self.runner is None:
            return self._follow(step, drafted)
        proposal = None
        if drafted is not None:
            proposal = Proposal(drafted.tokens, self._draft_rows(drafted), drafted.seconds)
        x, verdict, seconds = self.runner.run(step, proposal)
        verdict.features = verdict.features.cpu() if self._send_features else None
        return x, verdict, seconds

    def _follow(self, step: Step, drafted: Drafted | None) -> None:
        """A rank past 0: score the same trees (its share of each all-reduce), then commit
        what rank 0 broadcasts it verified (`_ShardTarget.commit`)."""
        dev, n = self.device, len(step.params)
        x = drafted.tokens if drafted else torch.zeros(n, 1, 1, dtype=torch.int64)
        self.shard.execute("score_logits", (step.tree(x, dev),))
        accepted = torch.zeros(2, n, dtype=torch.int64, device=dev)  # path, τ
        dist.broadcast(accepted, src=0)
        self.shard.execute("commit", tuple(accepted))

    def _draft_rows(self, drafted: Drafted) -> torch.Tensor:
        """The draft's rows q on the whole vocabulary [n, K, γ, V], on the shard's device."""
        rows = drafted.rows
        if isinstance(rows, SharedTensor):
            rows = self._rows.get(rows)
        q = rows.to(self.shard.device, non_blocking=True)
        if self._draft_vocab is None:
            return q
        full = q.new_zeros(*q.shape[:-1], self.shard.worker.model.spec.vocab_size)
        return full.index_copy_(-1, self._draft_vocab, q)


class _ShardTarget:
    """Rank 0's shard as its StepRunner's target: a score or a commit runs the group's
    collectives, and the commit first tells the other ranks what to keep."""

    def __init__(self, shard: TargetShard):
        self.shard, self.device = shard, shard.device

    @property
    def forward(self):
        """The shard's forwards (replayed from graphs where they are on: StepRunner.graphs)."""
        return self.shard.worker.forward

    def score(self, tree: DraftTree, params: list) -> torch.Tensor:
        """Processed rows [n, K, γ+1, V] along every path (the logits are whole on rank 0)."""
        return path_rows(self.shard.execute("score_logits", (tree,)), tree, params)

    def commit(self, path: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
        """path, τ: [n] int64 on the host. Rank 0 commits its host copy (its cache then keeps
        its lengths on the host)."""
        if self.shard.world > 1:
            dist.broadcast(torch.stack([path, num_accepted]).to(self.device), src=0)
        return self.shard.execute("commit", (path, num_accepted))


class WorkerLost(RuntimeError):
    """An actor of the step died (its process was killed, its node lost). The proxies can
    `restart` their actors; the caches are gone with them (the engine rebuilds them)."""


class StepTimedOut(TimeoutError):
    """Replies of a step that did not come in time: an actor is alive but stuck (a hung
    process, a collective whose peer never came)."""


class _Remote:
    """One or more actors that run the same ops in lockstep, over their links (`wire`)."""

    # A step's replies not all in after this long: the step's actors are restarted (None:
    # wait forever). A replica sets its ReplicaConfig.step_timeout_s.
    step_timeout_s: float | None = None

    def __init__(self, launch: Callable[[ray.ObjectRef | None], list]):
        use_numpy_wire()
        self._launch = launch  # starts the actors, with the weights to load (None: read them)
        self.actors = launch(None)
        self.links: list[Link] = []  # one per actor, in `actors`' order: set by `wire`
        # The model's weights in the object store of the first actor's node, owned by this
        # process (a call's return value is its caller's), so they outlive every actor: a
        # restarted actor copies them out of shared memory instead of reading the checkpoint
        # through transformers (~2 s of a ~4.5 s restart on the default pair). One copy per
        # model, for this proxy's life.
        self.weights: ray.ObjectRef | None = None

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Wait until every actor has loaded its model (raises a load failure). The first
        time, also take the first actors' weights over (`weights`), for every restart."""
        ray.get([a.ready.remote() for a in self.actors], timeout=timeout_s)
        if self.weights is None:  # the first actors, loaded: they hand their weights over
            self.weights = self.actors[0].weights.remote()

    def alive(self, timeout_s: float = 10.0) -> bool:
        """Whether every actor of the group answers (its Ray calls run beside its links)."""
        try:
            self.wait_ready(timeout_s)
            return True
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False

    def restart(self) -> None:
        """Replace every actor of the group with a fresh one: models reloaded, caches empty
        (`wait_ready` waits for the load; `wire` links them again)."""
        self.abandon()  # a survivor of a tensor-parallel group cannot rejoin a new one
        self.actors = self._launch(self.weights)

    def close_links(self) -> None:
        """Close this end of the links: the actors' serving threads end on it."""
        for link in self.links:
            link.close()
        self.links = []

    def abandon(self) -> None:
        """Kill the actors (a stuck one still answers Ray's calls, beside its links, so it
        would pass for alive): `restart` starts new ones."""
        self.close_links()
        for actor in self.actors:
            ray.kill(actor)

    def _post(self, op: str, *args, to: list[Link] | None = None) -> None:
        """Send an op to every actor's link (or those of `to`), serialized once for all."""
        frames = dumps((op, args))
        try:
            for link in self.links if to is None else to:
                link.send_frames(frames)
        except LinkBroken as exc:
            raise WorkerLost(f"an actor's link broke: {exc}") from exc

    @property
    def device(self) -> torch.device:
        """Where the engine leaves the inputs: on the host, for the wire (each actor moves
        what it gets)."""
        return torch.device("cpu")

    def move(self, src: int, dst: int) -> None:
        self._post("move", src, dst)

    def graphs(self, strict: bool | None = None, sealed: bool | None = None) -> list[GraphCounts]:
        """Its actors' graph caches (StepExecutor.graphs): a call between steps."""
        replies = ray.get([actor.graphs.remote(strict, sealed) for actor in self.actors])
        return [counts for reply in replies for counts in reply]


class RemoteDraft(_Remote):
    """The draft actor's proxy (a `Draft`: workers/protocols.py)."""

    def __init__(self, launch: Callable[[], list], speculating: bool = False):
        super().__init__(launch)
        self.speculating = speculating  # the actor keeps a speculation cache

    def prefill(
        self,
        slot0: int,
        contexts: list[torch.Tensor],
        keep: list[int] | None = None,
        features: list[torch.Tensor] | None = None,
    ) -> None:
        self._post("prefill", slot0, contexts, keep, features)

    def speculation_stats(self) -> dict[str, int]:
        """The actor's speculation cache counters: hits, lookups, prepared ({}: no cache)."""
        return ray.get(self.actors[0].speculation_stats.remote())

    @functools.cached_property
    def feed(self) -> DraftFeed:
        """The actor's proposer's feed (the same model after a restart)."""
        return ray.get(self.actors[0].feed.remote())


class RemoteTarget(_Remote):
    """The target shard actors' proxy (a `Target`: workers/protocols.py)."""

    def use_draft(self, draft: RemoteDraft, timeout_s: float = 60.0) -> None:
        """Tell rank 0 which ids the draft's rows arrive on and whether the draft reads the
        target's features, then wire the links between the coordinator (this process), the
        draft actor and the ranks afresh (at start and after any restart)."""
        vocab = ray.get(draft.actors[0].head_vocab.remote())
        ray.get(self.actors[0].use_draft.remote(vocab, draft.feed.reads_features))
        draft.close_links()
        self.close_links()
        actors = self.actors + draft.actors
        nodes = ray.get([a.node.remote() for a in actors], timeout=timeout_s)
        here = ray.get_runtime_context().get_node_id()
        one_node = all(node == here for node, _ in nodes)
        # Listeners on loopback where the replica is one machine, else on the node's address.
        host = [LOOPBACK if one_node else ip for _, ip in nodes]
        key = new_key()
        ranks = [a.wire.remote(h, key) for a, h in zip(self.actors, host, strict=False)]
        ranks = ray.get(ranks, timeout=timeout_s)
        share_rows = nodes[0][0] == nodes[-1][0]  # q through shared memory: draft and rank 0
        wired = draft.actors[0].wire.remote(host[-1], key, ranks, share_rows)
        at_draft = ray.get(wired, timeout=timeout_s)
        draft.links = [dial(at_draft, key, "coordinator", timeout_s)]
        self.links = [dial(address, key, "coordinator", timeout_s) for address in ranks]

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
        to_draft: DraftPrefill,  # posts each group's draft inputs to the draft
    ) -> list[torch.Tensor]:
        """Prefill for a feature draft. Rank 0 prefills one padding group at a time
        (workers.draft.padding_groups of the contexts' lengths, in order) and sends what the
        draft's prefill reads of each as it is done; to_draft(lo, hi, inputs) posts it to the
        draft, which prefills it while rank 0 runs the next group. Returns the pending tokens'
        features [pending_i, E], which the requests' next step sends.

        Waits for every op posted to the ranks so far: the caller's wall time counts them (the
        step's `prefill`), not the next step's posted-compute seconds, so they count once."""
        args = (slot0, contexts, keep)
        rank0 = self.links[0]
        self._post("prefill_features", args, draft_keep, draft_pending, to=[rank0])
        self._post("prefill", *args, to=self.links[1:])  # the other ranks prefill whole
        try:
            for lo, hi in padding_groups([len(c) for c in contexts]):  # rank 0's groups
                message = rank0.recv(self.step_timeout_s)
                if isinstance(message, Reply):  # it failed before this group
                    break
                to_draft(lo, hi, message)
            else:
                message = rank0.recv(self.step_timeout_s)
        except LinkBroken as exc:
            raise WorkerLost(f"target rank 0's link broke: {exc}") from exc
        except TimeoutError as exc:  # stuck (its Ray calls still answer): restart the ranks
            self.abandon()
            raise WorkerLost(f"target rank 0 did not answer: {exc}") from exc
        if message.error is not None:
            raise message.error
        return message.out

    def speculate(
        self, draft: RemoteDraft, step: Step
    ) -> tuple[torch.Tensor, Verdict, dict[str, float]]:
        """One decode step over the links, waited once: draft → target shards → back.

        Returns (draft tokens [n, K, γ], the verdict, seconds per phase with `transfer`: the
        step's wall time beyond the actors' compute)."""
        start = time.perf_counter()
        try:
            frames = dumps(("step", (step,)))
            draft.links[0].send_frames(frames)
            if step.pending_features is not None:  # the ranks read none: framed again without
                frames = dumps(("step", (step.for_target(),)))
            for link in self.links:
                link.send_frames(frames)
            replies = _gather(self.links, self.step_timeout_s)
        except LinkBroken as exc:
            raise WorkerLost(f"an actor's link broke: {exc}") from exc
        except StepTimedOut as exc:  # which actor is stuck is unknown: restart them all
            draft.abandon()
            self.abandon()
            raise WorkerLost(f"the step's actors did not answer: {exc}") from exc
        failed = next((r.error for r in replies if r.error is not None), None)
        if failed is not None:
            if isinstance(failed, LinkBroken) or not (draft.alive() and self.alive()):
                raise WorkerLost(f"an actor of the step died: {failed!r}") from failed
            raise failed  # the step itself failed
        x, verdict, seconds = replies[0].out
        posted = sum(r.posted for r in replies) / len(replies)
        seconds["prefill"] = replies[0].draft_posted + posted  # prefills, moves, commits
        wall = time.perf_counter() - start
        seconds["transfer"] = max(wall - sum(seconds.values()), 0.0)
        return x, verdict, seconds


@dataclass
class RemoteRunner:
    """The engine's step executor over the actors (workers/step.py `StepExecutor`): one chained
    exchange per step (`RemoteTarget.speculate`); the draft actor runs the step's draft half
    and the target's rank 0 the rest, each with its StepRunner."""

    draft: RemoteDraft
    target: RemoteTarget

    @property
    def speculating(self) -> bool:
        return self.draft.speculating

    def run(self, step: Step) -> tuple[torch.Tensor, Verdict, dict[str, float]]:
        return self.target.speculate(self.draft, step)

    def graphs(self, strict: bool | None = None, sealed: bool | None = None) -> list[GraphCounts]:
        """StepExecutor.graphs: the draft actor's, then the target ranks'. An actor restarted
        after a loss comes back with its graphs to capture as shapes arrive (a warm-up would
        hold new requests for its length)."""
        return self.draft.graphs(strict, sealed) + self.target.graphs(strict, sealed)

    def restart_lost(self) -> None:
        """Restart the actor groups that no longer answer (both reload at once), then wire
        every actor's links afresh."""
        dead = [worker for worker in (self.draft, self.target) if not worker.alive()]
        for worker in dead:
            worker.restart()
        for worker in dead:
            worker.wait_ready()
        self.target.use_draft(self.draft)


def _gather(links: list[Link], timeout_s: float | None) -> list[Reply]:
    """Each link's reply, in order; returns early once one reports an error (when a shard of a
    tensor-parallel group fails, its peers wait in a collective that would never finish).
    Raises StepTimedOut when they are not all in within `timeout_s` (None: no bound)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    replies: dict[int, Reply] = {}
    while len(replies) < len(links):
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        waiting = [link for i, link in enumerate(links) if i not in replies]
        arrived = ready(waiting, left)
        if not arrived:
            message = f"{len(waiting)} of {len(links)} replies not in after {timeout_s} s"
            raise StepTimedOut(message)
        for link in arrived:
            reply = replies[links.index(link)] = link.recv()
            if reply.error is not None:
                return [reply]
    return [replies[i] for i in range(len(links))]


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
    forwards: DecodeForwards = DEFAULT_FORWARDS  # CUDA graphs, torch.compile, or eager


def start_draft(
    spec: ActorSpec, slots: int, max_len: int, speculation: tuple = (0,)
) -> RemoteDraft:
    """The draft actor, loading (`wait_ready` waits for it); `speculation`: its speculation
    cache's fan-out (0: none), downweight and max batch (workers/speculation.py)."""
    options = dict(num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, resources=spec.resources)

    def launch(weights: ray.ObjectRef | None) -> list:
        args = (spec.path, slots, max_len, spec.dtype, spec.device, spec.threads, speculation)
        actor = DraftActor.options(**options)
        return [actor.remote(*args, forwards=spec.forwards, weights=weights)]

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

    def launch(weights: ray.ObjectRef | None) -> list:
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
                spec.forwards,
                weights,
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
    target.wait_ready(timeout_s)  # loaded already: takes their weights over (`weights`)
    return target
