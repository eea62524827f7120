"""One decode step in one home: what it asks (`Step`), how it runs (`StepRunner`), what it
decides (`Verdict`).

The engine (service/engine.py) builds one `Step` from its batch; a `StepRunner` runs it:

  draft  -> K i.i.d. paths of γ tokens per request, and the rows q they were drawn from
  tree   -> each request's paths merged into a flattened prefix tree (workers/tree.py)
  target -> one forward over every node of every tree: the rows p along each path
  verify -> per (method, K, γ) group, batched (`verify_step`): per request the *accepted*
            draft tokens (τ, a prefix of one path), then one target token, *recovered* after
            a rejection or the *bonus* after a full acceptance; the verdict's tokens are these
            τ + 1 (a plain request: the one token sampled from its root row)
  commit -> the target keeps the root and the accepted path's τ nodes; the draft what its
            feed keeps of the path (`draft_keeps`)

In process the runner is the engine's executor and runs all five. Over Ray (workers/actors.py)
the same runner runs split: its `propose` in the draft actor, its `run` on the target's rank 0,
given the proposal that arrived from the draft, and its `keep` (the draft's commit) in the draft
actor, on the accepted paths rank 0 sends it; the links carry only the `Step`, the proposal,
the accepted paths and the result.
Neither side keeps generator state: every uniform is a hash of a request's key and the step's
root position (workers/sampling.py, verification.CounterDraws), so seeded output does not
depend on batch-mates or on where the step ran.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from blockspec.verification import (
    VERIFIERS,
    CounterDraws,
    TargetModification,
    VerifyGraphs,
    load_cpu_kernels,
    verify,
)
from blockspec.verification.backends import host_reads_are_free
from blockspec.verification.graphs import GraphCache
from blockspec.workers.protocols import Draft, DraftFeed, LocalDraft, LocalTarget, Target
from blockspec.workers.sampling import SamplingParams, sample
from blockspec.workers.speculation import SpeculationCache
from blockspec.workers.tree import TREE_GRAPHS, DraftTree, build_tree

PLAIN = "none"  # plain target decoding, no speculation (γ = 0)


@dataclass
class VerifyPlan:
    """What `verify_step` needs of the batch, and only that."""

    groups: list[tuple[str, int, int, list[int]]]  # (method, K, γ, rows), verified together
    carries: list[TargetModification | None]  # [n]: carried records (greedy_block, spectr_gbv)
    max_gamma: int  # the batch's largest γ (1 when it is all plain)
    draws: torch.Tensor  # [n, 2] int64: (verify key, root position), the verifiers' counters


@dataclass
class Step:
    """One step's rows, [n] in batch order, built once by the engine from its batch. The draft
    reads the pending tokens and features, the tree the roots, K and γ, verification its plan;
    the speculation cache looks proposals up by request id and last emitted prefix."""

    request_ids: list[str]  # [n]
    emitted: list[tuple[int, ...] | None]  # [n]: what each emitted last step (None: no step)
    num_paths: list[int]  # [n]: each request's K (0: plain)
    depth: list[int]  # [n]: each request's γ (0: plain)
    params: list[SamplingParams]  # [n]
    roots: torch.Tensor  # [n] int64: each tree's root, the last emitted token
    pending: torch.Tensor | None  # [n, P] int64: draft-pending tokens, padded; None: no drafting
    pending_count: torch.Tensor  # [n] int64, on the host: real tokens per row of `pending`
    draws: torch.Tensor  # [n, 2] int64: (draft key, root position) keying the draft's uniforms
    pending_features: torch.Tensor | None  # [n, P, E]: feature draft, the target's one back
    own_features: torch.Tensor | None  # [n] bool: feature draft, rows that read their own
    verification: VerifyPlan

    @property
    def drafted(self) -> bool:
        """The draft model runs (a batch of plain requests skips it)."""
        return self.pending is not None

    def tree(self, x: torch.Tensor, device: torch.device) -> DraftTree:
        """The step's trees on `device`, from the draft tokens x [n, K, γ] (on the host when
        they came over the wire: copied without waiting)."""
        x = x.to(device, non_blocking=True)
        paths, depths = on_device(device, self.num_paths), on_device(device, self.depth)
        return build_tree(self.roots.to(device, non_blocking=True), x, paths, depths)

    def for_target(self) -> Step:
        """The step as the target's ranks read it: without the draft's features (the largest
        of the draft's inputs; the proposal reaches the ranks from the draft)."""
        return replace(self, pending_features=None)


@dataclass
class Verdict:
    """One step's verification: what each request emits."""

    tokens: torch.Tensor  # [n, max γ + 1] int64: emitted tokens (τ accepted + 1), -1 padded
    num_accepted: torch.Tensor  # [n] int64: τ, accepted draft tokens
    path: torch.Tensor  # [n] int64: the draft path whose prefix was accepted
    carries: list[TargetModification | None]  # [n]: records for the request's next step
    # [n] bool: the request's carry holds a record that modifies upcoming rows (a feature
    # draft then keeps its own features). On an accelerator a request's carry may keep columns
    # dead for it, so this is read from the values, not the shapes.
    live: torch.Tensor
    # [n, γ+1, E]: the target's features at the root and the accepted tokens (the first τ + 1
    # of each row), set once the target has committed; what a feature draft reads next
    features: torch.Tensor | None = None


@dataclass
class Proposal:
    """A draft's proposal for a step: what the runner's `run` verifies."""

    tokens: torch.Tensor  # [n, K, γ] int64
    rows: torch.Tensor  # [n, K, γ, V]: the processed rows the tokens were drawn from
    seconds: float  # the draft's compute


class StepExecutor(Protocol):
    """How the engine's steps reach the workers, chosen once when the engine is built: a
    `StepRunner` in process, or `RemoteRunner` over Ray's actors (workers/actors.py)."""

    draft: Draft
    target: Target

    @property
    def speculating(self) -> bool:
        """A speculation cache prepares proposals (workers/speculation.py)."""
        ...

    def run(self, step: Step) -> tuple[torch.Tensor, Verdict, dict[str, float]]:
        """Draft, build the trees, score them, verify, and commit the target's accepted paths.
        Returns the draft tokens [n, K, γ], the verdict (its tokens, τ, path and live flags on
        the host: `verdict_on_host`) and the seconds per phase (StepTimes' names)."""
        ...

    def restart_lost(self) -> None:
        """Restart the workers that died (a step raised `WorkerLost`); their caches come back
        empty, for the engine to rebuild."""
        ...

    def graphs(self, strict: bool | None = None, sealed: bool | None = None) -> list[GraphCounts]:
        """Every graph cache the steps replay from, wherever it lives: each set `strict`
        and `sealed` where given (verification/graphs.py `GraphCache`), and its counts (none
        where no graphs are on). What a warm-up drives (service/warm_up.py)."""
        ...


@dataclass
class StepRunner:
    """Runs a `Step` over a draft and a target that can be called directly: the engine's
    executor in process, and the two halves of the step in Ray's actors (module doc). The
    step's tensors are made on the target's device; the host reads the verdict once a step."""

    target: LocalTarget | None  # None: the draft actor's half
    draft: LocalDraft | None = None  # None: rank 0's half (the proposal arrives)
    # Proposals prepared for the likeliest outcomes of each step's verification; None: off
    # (workers/speculation.py). In process they are prepared right after the step's own
    # proposal; the draft actor prepares them while the target's ranks score.
    speculation: SpeculationCache | None = None
    # (step, x, q) of the last proposal, for `prepare`
    _proposed: tuple | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.target is not None and host_reads_are_free(self.target.device):
            load_cpu_kernels()  # this process verifies: no first request pays their load

    @property
    def speculating(self) -> bool:
        return self.speculation is not None

    def graphs(self, strict: bool | None = None, sealed: bool | None = None) -> list[GraphCounts]:
        """StepExecutor.graphs, for this process's workers."""
        return control_graphs(graph_caches(self.draft, self.target), strict, sealed)

    def run(
        self, step: Step, proposal: Proposal | None = None
    ) -> tuple[torch.Tensor, Verdict, dict[str, float]]:
        """The whole step (StepExecutor.run); with `proposal` (rank 0: the draft actor's) the
        draft's part is done."""
        laps = _Laps()
        n, q, dev = len(step.params), None, self.target.device
        x = torch.zeros(n, 1, 1, dtype=torch.int64, device=dev)
        if proposal is not None:
            x, q = proposal.tokens, proposal.rows
            laps.seconds["draft"] = proposal.seconds
        elif step.drafted:
            x, q = self.propose(step)
            self.prepare()
            laps.lap("draft")
        x = x.to(dev, non_blocking=True)  # a proposal arrives on the host (over the wire)
        x, out_of_vocab = clamp_to_vocab(x, q)
        tree = step.tree(x, dev)
        laps.lap("tree")
        p = self.target.score(tree, step.params)  # [n, K, γ+1, V]
        laps.lap("target")
        verdict = verify_step(step.verification, x, q, p)
        # the commits and the engine read it on the host; it raises on out-of-vocabulary tokens
        x, verdict = verdict_on_host(x, verdict, out_of_vocab)
        laps.lap("verify")
        verdict.features = self.target.commit(verdict.path, verdict.num_accepted)
        laps.lap("target")  # the commit is the target's work too
        if step.drafted and self.draft is not None:  # (the draft actor's: on rank 0's word)
            self.keep(step, verdict.path, verdict.num_accepted, verdict.live)
            laps.lap("draft")
        return x, verdict, dict(laps.seconds, transfer=0.0)

    def propose(self, step: Step, whole_vocab: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's half: tokens [n, K, γ] and rows [n, K, γ, V] (whole_vocab False:
        [n, K, γ, Vh], on the draft head's ids). With a speculation cache, the prepared
        proposals of the outcomes that came true, the rest drafted now."""
        draft = self.draft
        if self.speculation is None:
            return draft.propose(
                step.pending, step.pending_count, step.num_paths, step.depth, step.params,
                step.draws, step.pending_features, whole_vocab=whole_vocab, own=step.own_features,
            )  # fmt: skip
        step = replace(step, pending=step.pending.to(draft.device, non_blocking=True))
        x, q = self.speculation.propose(draft, step)
        self._proposed = (step, x, q)
        head = draft.model.head_vocab
        return x, q if whole_vocab or head is None else q.index_select(-1, head)

    def prepare(self) -> None:
        """With a speculation cache: prepare the next step's proposals for the likeliest
        outcomes of the last proposal (before the engine's commit of this step)."""
        if self._proposed is not None:
            self.speculation.prepare(self.draft, *self._proposed)
            self._proposed = None

    def keep(
        self,
        step: Step,
        path: torch.Tensor,  # [n] int64: the accepted paths
        num_accepted: torch.Tensor,  # [n] int64: τ, on the host
        live: torch.Tensor,  # [n] bool: the verdict's live records, on the host
    ) -> None:
        """The draft's commit of a verified step: what its feed keeps of each accepted path
        (`draft_keeps`). In process `run` calls it; the draft actor, on rank 0's word."""
        _, kept = draft_keeps(self.draft.feed, step, num_accepted, live, self.speculating)
        if kept is not None:
            self.draft.commit(path, kept)

    def restart_lost(self) -> None:
        """Nothing to restart: workers in this process are lost only with it."""


def draft_keeps(
    feed: DraftFeed,
    step: Step,
    num_accepted: torch.Tensor,  # [n] int64: τ, on the host
    live: torch.Tensor,  # [n] bool: the verdict's live records, on the host
    speculating: bool,  # a speculation cache prepares proposals
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the draft keeps of a verified step, as the engine and the draft's commit both read
    it: (own [n] bool, kept [n] int64 or None). `own`: the requests whose feature draft keeps its
    own features for the next step (the engine's _Active.own_features): under a live record,
    and while a speculation cache prepares proposals, after every rejection (τ < γ:
    workers/speculation.py). `kept`: the draft tokens of each accepted path the draft keeps
    (DraftFeed.kept); None: no commit (nothing was drafted, or the feed keeps nothing)."""
    if not step.drafted:
        return live, None
    own = live | (num_accepted < torch.tensor(step.depth)) if speculating else live
    return own, feed.kept(num_accepted, own)


# Captured verifier calls of this process (the engine's, or the target's rank 0 actor's where
# verify_step runs): idle on CPU, where graphs never apply.
VERIFY_GRAPHS = VerifyGraphs()


@dataclass(frozen=True)
class GraphCounts:
    """A graph cache's counts: graphs captured (evicted ones included), held, and calls run
    eagerly once sealed."""

    captures: int
    held: int
    eager_calls: int


def graph_caches(*workers) -> list[GraphCache]:
    """This process's graph caches for the workers' steps: their replayed forwards and
    proposals (where their graphs are on) and, with those, the tree's and verifiers' graphs."""
    own = [getattr(w, name, None) for w in workers for name in ("forward", "proposals")]
    own = [c for c in own if isinstance(c, GraphCache)]
    return [*own, TREE_GRAPHS, VERIFY_GRAPHS] if own else []


def control_graphs(
    caches: list[GraphCache], strict: bool | None = None, sealed: bool | None = None
) -> list[GraphCounts]:
    """Sets each cache's `strict` and `sealed` where given; returns their counts."""
    for cache in caches:
        cache.strict = cache.strict if strict is None else strict
        cache.sealed = cache.sealed if sealed is None else sealed
    return [GraphCounts(c.captures, len(c), c.eager_calls) for c in caches]


def verify_step(
    plan: VerifyPlan,
    x: torch.Tensor,  # [n, K, γ] int64: draft tokens ([n, 1, 1] zeros when nothing drafted)
    q: torch.Tensor | None,  # [n, K, γ, V]: the processed draft rows x was sampled from
    p: torch.Tensor,  # [n, K, γ+1, V]: processed target rows along every path
) -> Verdict:
    """Verify every (method, K, γ) group of the batch; plain requests sample the root row.

    Where p is on a GPU, the verifiers that can replay from this process's CUDA graphs do.
    The verdict and the carries are on p's device."""
    n, dev = p.shape[0], p.device  # the verdict and carries live where p is
    x, q = x.to(dev), None if q is None else q.to(dev)  # (there already in process)
    carries = [None if c is None else c.to(dev) for c in plan.carries]  # Ray: from the wire
    draws = plan.draws  # on the host: the uniforms are hashed there and copied once
    (method, k, gamma, idx), *others = plan.groups
    if not others and method != PLAIN:  # the usual batch: the verifier's outputs are the verdict
        out = _verify_group(method, k, gamma, idx, x, q, p, draws, carries)
        live = torch.zeros(n, dtype=torch.bool, device=dev)
        if out.carry is not None:
            live = (out.carry.rows_left > 0).any(1)
            carries = out.carry.split()
        return Verdict(out.tokens, out.num_accepted, out.path, carries, live)
    tokens = torch.full((n, plan.max_gamma + 1), -1, dtype=torch.int64, device=dev)
    tau = torch.zeros(n, dtype=torch.int64, device=dev)
    path = torch.zeros(n, dtype=torch.int64, device=dev)
    live = torch.zeros(n, dtype=torch.int64, device=dev)  # int: packed with the above
    for method, k, gamma, idx in plan.groups:
        ix = group_rows(idx, dev)
        if method == PLAIN:
            tokens[ix, 0] = sample(p[ix, :1, 0], draws[idx])[:, 0]
            continue
        out = _verify_group(method, k, gamma, idx, x, q, p, draws, carries)
        tokens[ix, : gamma + 1] = out.tokens
        tau[ix], path[ix] = out.num_accepted, out.path
        if out.carry is not None:
            live[ix] = (out.carry.rows_left > 0).any(1).long()
            for i, carry in zip(idx, out.carry.split(), strict=True):
                carries[i] = carry
    return Verdict(tokens, tau, path, carries, live.bool())


def _verify_group(
    method: str,
    k: int,
    gamma: int,
    idx: list[int],  # the group's rows
    x: torch.Tensor,  # [n, K, γ] int64
    q: torch.Tensor,  # [n, K, γ, V]
    p: torch.Tensor,  # [n, K, γ+1, V]
    draws: torch.Tensor,  # [n, 2] int64: the verifiers' counter keys, on the host
    carries: list[TargetModification | None],  # [n]
):
    """One (method, K, γ) group's verify call (its rows taken in place when consecutive)."""
    ix = group_rows(idx, p.device)
    carry = None
    if VERIFIERS[method].modifies_target:
        empty = TargetModification.empty(1, p.device)
        carry = TargetModification.cat([carries[i] or empty for i in idx])
    return verify(
        method,
        x[ix, :k, :gamma],
        q[ix, :k, :gamma],
        p[ix, :k, : gamma + 1],
        CounterDraws(draws[idx]),
        carry=carry,
        validate=False,  # rows come from our own processing
        check_tokens=False,  # StepRunner.run clamped them; the verdict brings the flags back
        graphs=VERIFY_GRAPHS,
    )


def clamp_to_vocab(
    x: torch.Tensor,  # [n, K, γ] int64: draft tokens
    q: torch.Tensor | None,  # [n, K, γ, V]: the rows they were drawn from; None: none drafted
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x with ids outside [0, V) clamped in, so that no table lookup or gather of the step
    reads past its end (on a GPU, a device-side assert), and [n] bool: the rows that had one.
    Nothing is read back here: the flags return with the verdict (`verdict_on_host`), which
    fails the step."""
    if q is None:
        return x, None
    vocab = q.shape[-1]
    return x.clamp(0, vocab - 1), ((x < 0) | (x >= vocab)).flatten(1).any(1)


def verdict_on_host(
    x: torch.Tensor,  # [n, K, γ] int64: the draft tokens
    verdict: Verdict,
    out_of_vocab: torch.Tensor | None = None,  # [n] bool: rows whose draft tokens were clamped
) -> tuple[torch.Tensor, Verdict]:
    """The draft tokens x and the verdict's tokens, τ and path on the host, by one copy (off the
    CPU, the step's one wait for the device): what the commits and the engine read. Carries
    and features stay on the device, where the next step reads them. On the CPU: as they are.
    Raises ValueError when a row drew a token outside the vocabulary (the step is void)."""
    if x.device.type == "cpu" and verdict.tokens.device.type == "cpu":
        _check_vocab(out_of_vocab)
        return x, verdict
    flags = [] if out_of_vocab is None else [out_of_vocab[:, None]]  # none for a plain batch
    columns = [
        verdict.tokens, verdict.num_accepted[:, None], verdict.path[:, None],
        verdict.live[:, None], x.flatten(1), *flags,
    ]  # fmt: skip
    packed = torch.cat([c.to(verdict.tokens.device, torch.int64) for c in columns], dim=1).cpu()
    sizes = [verdict.tokens.shape[1], 1, 1, 1, x[0].numel(), len(flags)]
    tokens, tau, path, live, drafted, outside = packed.split(sizes, dim=1)
    _check_vocab(outside[:, 0].bool() if flags else None)
    host = replace(
        verdict, tokens=tokens, num_accepted=tau[:, 0], path=path[:, 0], live=live[:, 0].bool()
    )
    return drafted.view(x.shape), host


def _check_vocab(out_of_vocab: torch.Tensor | None) -> None:  # [n] on the host
    if out_of_vocab is not None and bool(out_of_vocab.any()):
        rows = out_of_vocab.nonzero()[:, 0].tolist()
        raise ValueError(f"the draft proposed tokens outside the vocabulary (rows {rows})")


def group_rows(idx: list[int], device: torch.device | None = None) -> slice | torch.Tensor:
    """How verify_step takes a group's rows: consecutive rows as a slice, so that a batch of
    one kind (the usual case) is verified in place. Indexing with a tensor copies the rows: at
    batch 8, K = 4, γ = 8 and V = 49152 that is ~100 MB a step, as much memory traffic as the
    verifier's own call (the verifiers never write to their inputs)."""
    if idx == list(range(idx[0], idx[-1] + 1)):
        return slice(idx[0], idx[-1] + 1)
    return torch.tensor(idx).to(device, non_blocking=True)


def on_device(device: torch.device, values: list) -> torch.Tensor:
    """int64 values on `device`, by a copy that does not wait for it (torch.tensor(values,
    device=...) copies blocking: the host would wait for all the device's queued work)."""
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


class _Laps:
    """Wall-clock seconds of one step's phases: each lap adds the time since the last one."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now
