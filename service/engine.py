"""Speculative engine: continuous batching over a draft worker and a target worker, in process
or over Ray actors (workers/actors.py).

One step for the batch of active requests (docs/architecture.md), with its phases timed
separately (`StepTimes`):
  plan:       the batch's pending tokens, K/γ, sampling settings and groups (`StepPlan`)
  speculate:  draft  -> K i.i.d. paths of γ tokens per request (draft worker)
              tree   -> merge each request's paths into a flattened prefix tree (workers.tree)
              target -> one forward over every node of every tree (target worker)
              verify -> per (method, K, γ) group, batched (`verify_step`); the target keeps
                        the accepted paths' KV entries
  commit:     the draft keeps its accepted tokens; append tokens, retire finished requests
Over Ray the speculate part is one chained call, and verification runs on the target's rank 0.
In process, the step's tensors are made on the workers' device and the host reads the verdict
once a step (`verdict_on_host`); over Ray they travel through the host anyway.

Requests join between steps (`add`) and leave when finished or cancelled (`cancel`); each has
its own method, K, γ, sampling settings, seed (a private torch.Generator used for both drafting
and verification, so its output does not depend on its batch-mates) and stop conditions.
Method ``none`` is plain autoregressive decoding with the target (the baseline). A mixed batch
runs the draft with the largest K and γ present and each request uses its own prefix of that;
requests with ``none`` still feed their tokens to the draft in such a batch (wasted work, kept
simple), while a batch of only ``none`` requests skips the draft model entirely.
A feature draft (EAGLE; workers/draft.py) also reads the target's features: the target hands
back those of every position it prefills or commits, and each request carries the ones its
draft has not read yet beside its pending tokens.
Method ``auto`` (service/policy.py) lets the engine's `AutoPolicy` pick each step's method, K
and γ for the batch's auto requests, from the replica's measured step times and acceptance.

Sessions: a request with a ``session_id`` parks its KV entries in one of ``max_sessions`` spare
cache slots when it finishes (least recently parked evicted first). The session's next request
(its prompt = the history + new tokens) takes the slot back and prefills only the tokens past the
longest cached prefix that still matches; KV of tokens generated past a stop is dropped.
"""

from __future__ import annotations

import functools
import itertools
import os
import time
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from service.policy import AUTO, PLAIN, Arm, AutoPolicy, AutoState, StepShape
from verification import VERIFIERS, TargetModification, VerifyGraphs, verify
from workers.draft import DraftWorker, padding_groups, split_features
from workers.sampling import SamplingParams, sample
from workers.target import TargetWorker
from workers.tree import build_tree


class InvalidArgument(ValueError):
    """A request field the caller got wrong (gRPC INVALID_ARGUMENT); the message starts with the
    field's name. Raised by the engine's own checks and by the gateway's (service/requests.py)."""


def check_method(
    method: str, k: int, gamma: int, max_k: int | None = None, max_gamma: int | None = None
) -> None:
    """Raise InvalidArgument unless `method` can run with K = k paths of γ = gamma tokens
    (within a deployment's max_k / max_gamma when given). Plain decoding ignores k and gamma."""
    if method not in (PLAIN, AUTO) and method not in VERIFIERS:
        raise InvalidArgument(
            f"method: unknown {method!r}; expected none, auto or one of {', '.join(VERIFIERS)}"
        )
    if method in (PLAIN, AUTO):  # auto chooses K and γ itself (service/policy.py)
        return
    _check_range("k", k, max_k)
    if VERIFIERS[method].single_path and k != 1:
        raise InvalidArgument(f"k: method {method!r} verifies a single path; k must be 1")
    _check_range("gamma", gamma, max_gamma)


def _check_range(name: str, value: int, most: int | None) -> None:
    if most is None and value < 1:
        raise InvalidArgument(f"{name}: {value} must be >= 1")
    if most is not None and not 1 <= value <= most:
        raise InvalidArgument(f"{name}: {value} out of range [1, {most}]")


def context_needed(prompt_tokens: int, max_new_tokens: int, method: str, gamma: int) -> int:
    """Cache positions a request may occupy: its prompt and output, plus the last step's
    overshoot (a step scores γ draft tokens past the last output token, and emits up to γ + 1
    tokens whose KV stays even past a stop) and 2 for the tokens pending in the caches. `auto`
    needs no more than plain decoding: it only drafts as far as a request's context allows."""
    return prompt_tokens + max_new_tokens + (gamma if method not in (PLAIN, AUTO) else 0) + 2


def check_context(
    prompt_tokens: int,
    max_new_tokens: int,
    method: str,
    gamma: int,
    max_context: int,
    history_tokens: int = 0,
) -> None:
    """Raise InvalidArgument unless the request fits a context of `max_context` positions;
    `history_tokens` of the prompt came from a session (named in the message)."""
    if context_needed(prompt_tokens, max_new_tokens, method, gamma) > max_context:
        where = f" ({history_tokens} from the session)" if history_tokens else ""
        raise InvalidArgument(
            f"prompt: {prompt_tokens} tokens{where} + max_new_tokens {max_new_tokens} + γ "
            f"exceed the model context ({max_context})"
        )


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int = 128
    method: str = "block"
    k: int = 1
    gamma: int = 4
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    request_id: str = ""
    session_id: str | None = None  # park the KV under this key when finished (max_sessions > 0)
    # Called with the tokens each step appends to the output (streaming), on the engine's thread.
    on_tokens: Callable[[list[int]], None] | None = field(default=None, repr=False, compare=False)


@dataclass
class StepTimes:
    """Wall-clock seconds of engine steps by phase. prefill = joining requests' prompts and KV
    slot moves (with Ray actors: the compute of every call posted since the last step);
    overhead = bookkeeping and the draft's commit; transfer = what the remote workers' calls
    took beyond their own compute (zero in-process)."""

    prefill: float = 0.0
    draft: float = 0.0
    tree: float = 0.0
    target: float = 0.0
    transfer: float = 0.0
    verify: float = 0.0
    overhead: float = 0.0
    batch_size: int = 0

    PHASES = ("prefill", "draft", "tree", "target", "transfer", "verify", "overhead")

    def add(self, other: StepTimes) -> None:
        for name in self.PHASES:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.batch_size += other.batch_size


@dataclass
class RequestStats:
    target_calls: int = 0
    accepted: int = 0  # draft tokens accepted in all
    accepted_per_position: list[int] = field(default_factory=list)  # [γ]: steps accepting pos i
    steps_by_config: Counter[str] = field(default_factory=Counter)  # steps per Arm (`auto`)
    # Sums over the steps this request was part of (their time is shared with its batch-mates).
    steps: StepTimes = field(default_factory=StepTimes)

    @property
    def mean_batch_size(self) -> float:
        return self.steps.batch_size / max(self.target_calls, 1)

    @property
    def tokens_per_call(self) -> float:
        """Block efficiency: emitted tokens per target call (accepted + 1 per call)."""
        return (self.accepted + self.target_calls) / max(self.target_calls, 1)


@dataclass
class GenerationResult:
    request_id: str
    token_ids: list[int]
    finish_reason: str  # "length" | "stop" (a cancelled request has no result)
    stats: RequestStats
    cached_tokens: int = 0  # prompt tokens whose target KV came from the session's parked slot


@dataclass
class StepResult:
    """What one engine step did: the requests it finished and where its time went."""

    finished: list[GenerationResult]
    times: StepTimes  # this step's (all zero when there was nothing to run)


@dataclass
class VerifyPlan:
    """What `verify_step` needs of the batch, and only that: in the service it travels with
    the step's call to the target's rank 0, which verifies next to its rows."""

    groups: list[tuple[str, int, int, list[int]]]  # (method, K, γ, rows), verified together
    carries: list[TargetModification | None]  # [n]: carried records (greedy_block, spectr_gbv)
    max_gamma: int  # the batch's largest γ (1 when it is all plain)


@dataclass
class StepPlan:
    """What one step asks of the workers, built from the batch (no generators)."""

    pending: torch.Tensor | None  # [n, P] int64: draft-pending tokens, padded; None: no drafting
    pending_count: torch.Tensor  # [n] int64: real tokens per row of `pending`
    pending_features: torch.Tensor | None  # [n, P, E]: feature draft, the target's one back
    own_features: torch.Tensor | None  # [n] bool: feature draft, rows that read their own
    num_paths: list[int]  # [n]: each request's K (0: plain)
    depth: list[int]  # [n]: each request's γ (0: plain)
    roots: torch.Tensor  # [n] int64: each tree's root, the last emitted token
    params: list[SamplingParams]
    verification: VerifyPlan

    @property
    def drafted(self) -> bool:
        """The draft model runs (a batch of plain requests skips it)."""
        return self.pending is not None


@dataclass
class Verdict:
    """One step's verification: what each request emits."""

    tokens: torch.Tensor  # [n, max γ + 1] int64: emitted tokens, -1 padded
    num_accepted: torch.Tensor  # [n] int64: τ, accepted draft tokens
    path: torch.Tensor  # [n] int64: the draft path whose prefix was accepted
    carries: list[TargetModification | None]  # [n]: records for the request's next step
    # [n] bool: the request's carry holds a record that modifies upcoming rows (a feature
    # draft then keeps its own features: _Active.own_features). On an accelerator a request's
    # carry may keep columns dead for it, so this is read from the values, not the shapes.
    live: torch.Tensor
    # [n, γ+1, E]: the target's features at the root and the accepted tokens (the first τ + 1
    # of each row), set once the target has committed; what a feature draft reads next
    features: torch.Tensor | None = None


# Captured verifier calls of this process (the engine's, or the target's rank 0 actor's where
# verify_step runs): idle on CPU, where graphs never apply.
VERIFY_GRAPHS = VerifyGraphs()


def verify_step(
    plan: VerifyPlan,
    x: torch.Tensor,  # [n, K, γ] int64: draft tokens ([n, 1, 1] zeros when nothing drafted)
    q: torch.Tensor | None,  # [n, K, γ, V]: the processed draft rows x was sampled from
    p: torch.Tensor,  # [n, K, γ+1, V]: processed target rows along every path
    generators: list[torch.Generator],  # [n]
) -> Verdict:
    """Verify every (method, K, γ) group of the batch; plain requests sample the root row.

    Pure, so it runs wherever p is: in the engine's process, or on the target's rank 0 actor
    (workers/actors.py), which then commits the accepted paths itself. Where p is on a GPU,
    the verifiers that can replay from that process's CUDA graphs do. The verdict and the
    carries are on p's device."""
    n, dev = p.shape[0], p.device  # the verdict and carries live where p is
    x, q = x.to(dev), None if q is None else q.to(dev)  # (there already in process)
    tokens = torch.full((n, plan.max_gamma + 1), -1, dtype=torch.int64, device=dev)
    tau = torch.zeros(n, dtype=torch.int64, device=dev)
    path = torch.zeros(n, dtype=torch.int64, device=dev)
    live = torch.zeros(n, dtype=torch.int64, device=dev)  # int: packed with the above
    carries = [None if c is None else c.to(dev) for c in plan.carries]  # Ray: from the wire
    for method, k, gamma, idx in plan.groups:
        ix = group_rows(idx, dev)
        gens = [generators[i] for i in idx]
        if method == PLAIN:
            tokens[ix, 0] = sample(p[ix, :1, 0], gens)[:, 0]
            continue
        carry = None
        if VERIFIERS[method].modifies_target:
            empty = TargetModification.empty(1, dev)
            carry = TargetModification.cat([carries[i] or empty for i in idx])
        out = verify(
            method,
            x[ix, :k, :gamma],
            q[ix, :k, :gamma],
            p[ix, :k, : gamma + 1],
            gens,
            carry=carry,
            validate=False,  # rows come from our own processing
            graphs=VERIFY_GRAPHS,
        )
        tokens[ix, : gamma + 1] = out.tokens
        tau[ix], path[ix] = out.num_accepted, out.path
        if out.carry is not None:
            live[ix] = (out.carry.rows_left > 0).any(1).long()
            for i, carry in zip(idx, out.carry.split(), strict=True):
                carries[i] = carry
    return Verdict(tokens, tau, path, carries, live.bool())


def verdict_on_host(x: torch.Tensor, verdict: Verdict) -> tuple[torch.Tensor, Verdict]:
    """The draft tokens x and the verdict's tokens, τ and path on the host, by one copy (off the
    CPU, the step's one wait for the device): what the commits and `_advance` read. Carries and
    features stay on the device, where the next step reads them. On the CPU: as they are."""
    if x.device.type == "cpu" and verdict.tokens.device.type == "cpu":
        return x, verdict
    width = verdict.tokens.shape[1]
    columns = [
        verdict.tokens, verdict.num_accepted[:, None], verdict.path[:, None],
        verdict.live[:, None].long(), x.flatten(1),
    ]  # fmt: skip
    packed = torch.cat([c.to(verdict.tokens.device) for c in columns], dim=1).cpu()
    tokens, tau, path, live, drafted = packed.split([width, 1, 1, 1, x[0].numel()], dim=1)
    host = replace(
        verdict, tokens=tokens, num_accepted=tau[:, 0], path=path[:, 0], live=live[:, 0].bool()
    )
    return drafted.view(x.shape), host


def verify_on_host(
    plan: VerifyPlan,
    x: torch.Tensor,
    q: torch.Tensor | None,
    p: torch.Tensor,
    generators: list[torch.Generator],
) -> Verdict:
    """verify_step, with the verdict's tokens, τ and path then on the host (verdict_on_host):
    what a remote target's rank 0 verifies with, commits from and sends back."""
    return verdict_on_host(x, verify_step(plan, x, q, p, generators))[1]


def group_rows(idx: list[int], device: torch.device | None = None) -> slice | torch.Tensor:
    """How verify_step takes a group's rows: consecutive rows as a slice, so that a batch of
    one kind (the usual case) is verified in place. Indexing with a tensor copies the rows: at
    batch 8, K = 4, γ = 8 and V = 49152 that was ~100 MB and 12 ms a step on a 2-core VM, as
    long as the SpecTr-GBV* call itself (the verifiers never write to their inputs)."""
    if idx == list(range(idx[0], idx[-1] + 1)):
        return slice(idx[0], idx[-1] + 1)
    return torch.tensor(idx).to(device, non_blocking=True)


def _device(worker) -> torch.device:
    """Where a worker wants its inputs (remote workers: on the host, for the wire)."""
    return getattr(worker, "device", torch.device("cpu"))


def _on(device: torch.device, values: list) -> torch.Tensor:
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


@dataclass
class _Active:
    req: GenerationRequest
    generator: torch.Generator
    target_pending: int  # last emitted token: root of the next tree, not yet in target's cache
    draft_pending: list[int]  # emitted tokens not yet run through the draft (1 or 2)
    arm: Arm  # what the next step runs: the request's own, or what `auto` chose for it
    auto: AutoState | None = None  # method auto: what the policy knows of this request
    # feature draft: [len(draft_pending), E], the target's feature before each pending token
    draft_features: torch.Tensor | None = None
    # feature draft: the carry holds a live record, so the draft keeps the law it was written
    # against (its own features past the record's root; workers/draft.py)
    own_features: bool = False
    output: list[int] = field(default_factory=list)
    carry: TargetModification | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    emitted: int = 0  # tokens emitted so far, including any past a stop (they are in the caches)
    cached_tokens: int = 0


@dataclass
class _Parked:
    """A finished session's KV, kept in a spare slot for its next request."""

    slot: int
    tokens: list[int]  # the session's history; the caches hold KV of its first *_len tokens
    draft_len: int
    target_len: int


class SpeculativeEngine:
    """Workers' caches need max_batch + max_sessions slots: [0, max_batch) for active requests,
    the rest for parked sessions."""

    def __init__(
        self,
        draft: DraftWorker,
        target: TargetWorker,
        max_batch: int,
        max_len: int,
        vocab_size: int,
        max_sessions: int = 0,
        policy: AutoPolicy | None = None,
    ):
        self.draft, self.target = draft, target
        # EAGLE-style draft: reads the target's features (workers/draft.py)
        self.feature_draft = draft.reads_features
        self.policy = policy or AutoPolicy()
        self.max_batch, self.max_len, self.max_sessions = max_batch, max_len, max_sessions
        self.vocab_size = vocab_size
        self.active: list[_Active] = []  # slot i of both caches belongs to active[i]
        self.waiting: list[_Active] = []
        self.parked: OrderedDict[str, _Parked] = OrderedDict()  # oldest first
        self.free_slots = list(range(max_batch + max_sessions - 1, max_batch - 1, -1))
        self.times = StepTimes()
        self.steps = 0
        self._ids = itertools.count()

    def reset_stats(self) -> None:
        """Zero the cumulative step counters `times` and `steps` (benchmarks)."""
        self.times, self.steps = StepTimes(), 0

    # ---------------------------------------------------------------- admission
    def validate(self, req: GenerationRequest) -> None:
        """Raise InvalidArgument (a ValueError) naming the field of a request the engine cannot
        serve."""
        if not req.prompt_ids:
            raise InvalidArgument("prompt: empty")
        if any(not 0 <= t < self.vocab_size for t in req.prompt_ids):
            raise InvalidArgument(f"prompt: token ids must lie in [0, {self.vocab_size})")
        check_method(req.method, req.k, req.gamma)
        if req.max_new_tokens < 1:
            raise InvalidArgument("max_new_tokens: must be >= 1")
        check_context(len(req.prompt_ids), req.max_new_tokens, req.method, req.gamma, self.max_len)

    def add(self, req: GenerationRequest) -> str:
        self.validate(req)
        if not req.request_id:
            req.request_id = f"req-{next(self._ids)}"
        seed = req.seed if req.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        gen = torch.Generator().manual_seed(seed)
        last = req.prompt_ids[-1]
        arm, auto, gamma = Arm(req.method, req.k, req.gamma), None, req.gamma
        if req.method == AUTO:
            room = self.max_len - context_needed(len(req.prompt_ids), req.max_new_tokens, AUTO, 0)
            auto, gamma = AutoState(room, req.max_new_tokens), self.policy.max_gamma
        stats = RequestStats(accepted_per_position=[0] * max(gamma, 1))
        self.waiting.append(_Active(req, gen, last, [last], arm, auto, stats=stats))
        return req.request_id

    def cancel(self, request_id: str) -> bool:
        """Drop a waiting or active request (between steps); its KV slot is freed, not parked."""
        for i, a in enumerate(self.waiting):
            if a.req.request_id == request_id:
                del self.waiting[i]
                return True
        for i, a in enumerate(self.active):
            if a.req.request_id == request_id:
                self._retire(i, park=False)
                return True
        return False

    def _admit(self) -> int:
        """Move waiting requests into free batch slots and prefill them; returns the prompt
        tokens the target prefilled."""
        room = self.max_batch - len(self.active)
        new, self.waiting = self.waiting[:room], self.waiting[room:]
        if not new:
            return 0
        slot0 = len(self.active)
        keep_draft, keep_target = [], []
        for slot, a in enumerate(new, start=slot0):
            kd = kt = 0
            parked = self.parked.pop(a.req.session_id, None) if a.req.session_id else None
            if parked is not None:
                prompt = a.req.prompt_ids
                pairs = zip(parked.tokens, prompt, strict=False)
                same = next(
                    (i for i, (x, y) in enumerate(pairs) if x != y),
                    min(len(parked.tokens), len(prompt)),
                )
                usable = min(same, len(prompt) - 1)  # the last prompt token stays pending
                kd, kt = min(parked.draft_len, usable), min(parked.target_len, usable)
                self.draft.move(parked.slot, slot)
                self.target.move(parked.slot, slot)
                self.free_slots.append(parked.slot)
            if self.feature_draft:  # the draft keeps one past the target, or both 0: _prefill
                kt = min(kt, kd - 1, len(a.req.prompt_ids) - 2)
                kt, kd = (kt, kt + 1) if kt >= 0 else (0, 0)
            a.cached_tokens = kt
            keep_draft.append(kd)
            keep_target.append(kt)
        prefilled = self._prefill(slot0, new, keep_draft, keep_target)
        self.active.extend(new)
        return prefilled

    def _prefill(
        self, slot0: int, batch: list[_Active], keep_draft: list[int], keep_target: list[int]
    ) -> int:
        """Prefill slots slot0.. (active requests) with their tokens but the pending ones, past
        what each cache keeps; returns the tokens the target prefilled.

        A feature draft's position t reads the target's feature at t - 1 (zero at t = 0), so
        the target runs first and the draft's kept prefix ends one past the target's (or both
        are 0): the target's new features then cover exactly the draft's new positions and the
        pending token's."""
        tokens = [a.req.prompt_ids + a.output for a in batch]

        def rest(keep: list[int], pending: list[int]) -> list[torch.Tensor]:
            return [
                torch.tensor(t[n : len(t) - p], dtype=torch.int64)
                for t, n, p in zip(tokens, keep, pending, strict=True)
            ]

        draft_pending = [len(a.draft_pending) for a in batch]
        contexts = rest(keep_target, [1] * len(tokens))
        if not self.feature_draft:
            self.target.prefill(slot0, contexts, keep_target)
            self.draft.prefill(slot0, rest(keep_draft, draft_pending), keep_draft)
            return sum(len(c) for c in contexts)
        draft_contexts = rest(keep_draft, draft_pending)

        def draft_prefill(lo: int, hi: int, inputs) -> None:  # one of the target's groups
            self.draft.prefill(slot0 + lo, draft_contexts[lo:hi], keep_draft[lo:hi], inputs)

        remote = getattr(self.target, "prefill_features", None)
        if remote is not None:  # Ray actors: the draft prefills a group while the target
            # runs the next one, its features sent from rank 0 to the draft actor
            args = (slot0, contexts, keep_target, keep_draft, draft_pending, draft_prefill)
            tails = remote(*args)
        else:  # the same draft calls, so the same batches and bits
            features = self.target.prefill(slot0, contexts, keep_target)
            inputs, tails = split_features(features, keep_draft, draft_pending)
            for lo, hi in padding_groups([len(c) for c in contexts]):
                draft_prefill(lo, hi, inputs[lo:hi])
        for a, tail in zip(batch, tails, strict=True):
            a.draft_features = tail
        return sum(len(c) for c in contexts)

    def _park(self, index: int) -> None:
        """Keep active[index]'s KV in a spare slot under its session id."""
        a = self.active[index]
        old = self.parked.pop(a.req.session_id, None)
        if old is not None:
            self.free_slots.append(old.slot)
        if not self.free_slots:
            self.free_slots.append(self.parked.popitem(last=False)[1].slot)
        slot = self.free_slots.pop()
        history = a.req.prompt_ids + a.output
        total = len(a.req.prompt_ids) + a.emitted  # what the caches hold, minus pending tokens
        self.draft.move(index, slot)
        self.target.move(index, slot)
        self.parked[a.req.session_id] = _Parked(
            slot,
            history,
            draft_len=min(total - len(a.draft_pending), len(history)),
            target_len=min(total - 1, len(history)),
        )

    def _retire(self, index: int, park: bool = True) -> None:
        if park and self.active[index].req.session_id and self.max_sessions:
            self._park(index)
        last = len(self.active) - 1
        if index != last:
            self.draft.move(last, index)
            self.target.move(last, index)
            self.active[index] = self.active[last]
        self.active.pop()

    def recover(self) -> list[str]:
        """Restart the remote workers' dead actors and rebuild both caches (after `WorkerLost`).
        Returns the ids of the requests it dropped (cancelled) instead: those whose feature
        draft kept its own features for a live record, a law a rebuild from true features
        would not reproduce (workers/draft.py).

        Both caches are rebuilt, a survivor's too: the failed step may have run on it (the
        draft appends its pending tokens when it proposes). Every active request is prefilled
        again from its own tokens (prompt + output, minus the tokens each cache holds as
        pending); parked sessions are dropped, so a session's next request prefills from the
        history it carries. The failed step changed no request state (generator states and
        carries are set only when it returns), so the next step redoes it with the same draws."""
        dead = [worker for worker in (self.draft, self.target) if not worker.alive()]
        for worker in dead:  # both reload at once
            worker.restart()
        for worker in dead:
            worker.wait_ready()
        self.free_slots += [parked.slot for parked in self.parked.values()]
        self.parked.clear()
        lost = [a.req.request_id for a in self.active if a.own_features]
        for request_id in lost:
            self.cancel(request_id)
        if self.active:
            zeros = [0] * len(self.active)
            self._prefill(0, self.active, zeros, zeros)
        return lost

    # ---------------------------------------------------------------- one step
    @torch.inference_mode()
    def step(self) -> StepResult:
        """One speculative step for every active request: plan, speculate, commit."""
        admitting = time.perf_counter()
        prefilled = self._admit()
        if not self.active:
            return StepResult([], StepTimes())
        batch = list(self.active)  # self.active shrinks as finished requests retire
        start = time.perf_counter()
        prefill = start - admitting
        auto = self._choose_auto(batch, prefilled)
        plan = self._plan(batch)
        planned = time.perf_counter()
        x, verdict, seconds = self._speculate(plan, [a.generator for a in batch])
        speculated = time.perf_counter()
        live = verdict.live.tolist()  # on the host (verdict_on_host)
        for a, carry, alive in zip(batch, verdict.carries, live, strict=True):
            a.carry = carry
            a.own_features = self.feature_draft and alive
        # The target committed its paths itself. A feature draft keeps a path only under a
        # live record (see _Active.own_features): with none in the batch it has nothing to keep
        # (a call over Ray, and a pass over the suffix, saved).
        if plan.drafted and not self.feature_draft:
            self.draft.commit(verdict.path, verdict.num_accepted)
        elif plan.drafted and any(live):
            self.draft.commit(verdict.path, torch.where(verdict.live, verdict.num_accepted, 0))
        if auto is not None:  # the step's whole wall time: the cost model knows the prefill
            arm, shape = auto
            accepted = verdict.num_accepted.tolist()
            outcomes = [(a.auto, accepted[i]) for i, a in enumerate(batch) if a.auto is not None]
            self.policy.observe(arm, shape, time.perf_counter() - admitting, outcomes)
        finished = self._advance(plan, x, verdict)
        seconds["overhead"] = planned - start + time.perf_counter() - speculated
        seconds["prefill"] = seconds.get("prefill", 0.0) + prefill  # remote: posted calls
        times = StepTimes(**seconds, batch_size=len(batch))
        for a in batch:
            a.stats.steps.add(times)
        self.times.add(times)
        self.steps += 1
        return StepResult(finished, times)

    def _choose_auto(self, batch: list[_Active], prefilled: int) -> tuple[Arm, StepShape] | None:
        """Set the arm of the batch's auto requests (service/policy.py): from finished steps
        only, before this step draws anything. Returns (arm, the step's shape), or None when
        the batch has no auto request."""
        auto = [a.auto for a in batch if a.auto is not None]
        if not auto:
            return None
        fixed = [a.arm for a in batch if a.auto is None and a.arm.method != PLAIN]
        shape = StepShape(
            batch_size=len(batch),
            fixed_nodes=sum(arm.nodes for arm in fixed),
            fixed_multi_nodes=sum(arm.nodes for arm in fixed if arm.k > 1),
            fixed_depth=max((arm.gamma for arm in fixed), default=0),
            prefill_tokens=prefilled,
        )
        arm = self.policy.choose(auto, shape)
        for a in batch:
            if a.auto is not None:
                a.arm = arm
        return arm, shape

    def _plan(self, batch: list[_Active]) -> StepPlan:
        plain = [a.arm.method == PLAIN for a in batch]
        pending = features = own = None
        # On the host: the draft reads the counts there (KVCache), and moves them itself.
        counts = torch.tensor([len(a.draft_pending) for a in batch])
        if not all(plain):  # a batch of plain requests never touches the draft model
            width = max(len(a.draft_pending) for a in batch)
            padded = [a.draft_pending + [0] * (width - len(a.draft_pending)) for a in batch]
            pending = _on(_device(self.draft), padded)
            if self.feature_draft:
                features = torch.nn.utils.rnn.pad_sequence(
                    [a.draft_features for a in batch], batch_first=True
                )
                if any(a.own_features for a in batch):
                    own = torch.tensor([a.own_features for a in batch])
        groups = defaultdict(list)
        for i, a in enumerate(batch):
            groups[(a.arm.method, a.arm.k, a.arm.gamma)].append(i)
        return StepPlan(
            pending=pending,
            pending_count=counts,
            pending_features=features,
            own_features=own,
            num_paths=[0 if pl else a.arm.k for a, pl in zip(batch, plain, strict=True)],
            depth=[0 if pl else a.arm.gamma for a, pl in zip(batch, plain, strict=True)],
            roots=_on(_device(self.target), [a.target_pending for a in batch]),
            params=[a.req.sampling for a in batch],
            verification=VerifyPlan(
                groups=[(*key, idx) for key, idx in groups.items()],
                carries=[a.carry for a in batch],
                max_gamma=max((a.arm.gamma for a in batch if a.arm.method != PLAIN), default=1),
            ),
        )

    def _speculate(
        self, plan: StepPlan, generators: list[torch.Generator]
    ) -> tuple[torch.Tensor, Verdict, dict[str, float]]:
        """Draft, build the trees, score them, verify, and commit the target's accepted paths.

        Returns the draft tokens [n, K, γ], the verdict and the seconds per phase."""
        remote = getattr(self.target, "speculate", None)
        if remote is not None:  # Ray actors (workers/actors.py): one chained call per step
            draft_args = None
            if plan.drafted:
                draft_args = (
                    plan.pending, plan.pending_count, plan.num_paths, plan.depth,
                    plan.pending_features, plan.own_features,
                )  # fmt: skip
            verify_here = functools.partial(verify_on_host, plan.verification)
            return remote(
                self.draft, draft_args, plan.roots, plan.num_paths, plan.depth, plan.params,
                generators, verify_here,
            )  # fmt: skip
        laps = _Laps()
        n, q, dev = len(generators), None, _device(self.target)
        x = torch.zeros(n, 1, 1, dtype=torch.int64, device=dev)
        if plan.drafted:
            x, q = self.draft.propose(
                plan.pending, plan.pending_count, plan.num_paths, plan.depth, plan.params,
                generators, plan.pending_features, own=plan.own_features,
            )  # fmt: skip
        laps.lap("draft")
        paths, depths = _on(dev, plan.num_paths), _on(dev, plan.depth)
        tree = build_tree(plan.roots, x.to(dev), paths, depths)
        laps.lap("tree")
        p = self.target.score(tree, plan.params)  # [n, K, γ+1, V]
        laps.lap("target")
        verdict = verify_step(plan.verification, x, q, p, generators)
        x, verdict = verdict_on_host(x, verdict)  # both commits and `_advance` read it there
        laps.lap("verify")
        verdict.features = self.target.commit(verdict.path, verdict.num_accepted)
        laps.lap("target")  # the commit is the target's work too
        return x, verdict, dict(laps.seconds, transfer=0.0)

    def _advance(self, plan: StepPlan, x: torch.Tensor, verdict: Verdict) -> list[GenerationResult]:
        """Append emitted tokens, update pending tokens and stats; retire finished requests."""
        tokens, tau, path = verdict.tokens, verdict.num_accepted, verdict.path
        done: list[int] = []
        results = []
        # draft tokens per path that the draft has run
        run = min(plan.verification.max_gamma - 1, x.shape[2])
        for i, a in enumerate(self.active):
            t = int(tau[i])
            emitted = tokens[i, : t + 1].tolist()
            a.stats.target_calls += 1
            a.stats.steps_by_config[str(a.arm)] += 1
            a.stats.accepted += t
            a.emitted += len(emitted)
            for pos in range(min(t, len(a.stats.accepted_per_position))):
                a.stats.accepted_per_position[pos] += 1
            a.target_pending = emitted[-1]
            # A feature draft keeps no draft-path entries (it reruns them with true features)
            # unless the request carries a live record (step: a.own_features).
            keeps_path = a.arm.method != PLAIN and (not self.feature_draft or a.own_features)
            if plan.drafted:  # the draft ran the old pending tokens and `committed` path tokens
                committed = min(t, run) if keeps_path else 0
                a.draft_pending = [*x[i, int(path[i]), committed:t].tolist(), emitted[-1]]
            else:  # the draft did not run: it still has to see everything since
                a.draft_pending = a.draft_pending + emitted
            if a.own_features:  # one pending token, whose feature the draft kept itself
                if len(a.draft_pending) != 1:  # a live record ends inside the path's run part
                    raise RuntimeError("a live record outlived its path's drafted tokens")
                a.draft_features = verdict.features.new_zeros(1, verdict.features.shape[-1])
            elif self.feature_draft:  # the target's features before the new pending tokens
                new = verdict.features[i, : t + 1]
                a.draft_features = new if plan.drafted else torch.cat([a.draft_features, new])
            reason = None
            before = len(a.output)
            for tok in emitted:
                a.output.append(tok)
                if tok in a.req.stop_token_ids:
                    reason = "stop"
                    break
                if len(a.output) >= a.req.max_new_tokens:
                    reason = "length"
                    break
            if a.auto is not None:
                a.auto.remaining = a.req.max_new_tokens - len(a.output)
            if a.req.on_tokens is not None:
                a.req.on_tokens(a.output[before:])
            if reason:
                results.append(
                    GenerationResult(a.req.request_id, a.output, reason, a.stats, a.cached_tokens)
                )
                done.append(i)
        for i in reversed(done):
            self._retire(i)
        return results

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Run requests to completion (continuous batching); results in request order."""
        ids = [self.add(r) for r in requests]
        results: dict[str, GenerationResult] = {}
        while self.active or self.waiting:
            for res in self.step().finished:
                results[res.request_id] = res
        return [results[i] for i in ids]


def build_engine(
    draft_dir: str,
    target_dir: str,
    max_batch: int = 16,
    max_len: int = 1024,
    dtype: str = "float32",
    device: str = "cpu",
    tensor_parallel: int = 1,
    max_sessions: int = 0,
    auto_arms: list[str] | None = None,
    packed: bool | None = None,
):
    """Engine over a local draft/target pair; the target split over `tensor_parallel` ranks
    (spawned processes, gloo on CPU) when > 1. `max_len` is capped at the models' context.
    `packed=False` keeps F.linear on dense weights where a CPU would pack them (a benchmark's
    baseline; see workers.llama.Linear). Returns (engine, tokenizer)."""
    from workers.models import DTYPES, load_pair
    from workers.tensor_parallel import TensorParallelTarget

    d, t, tokenizer = load_pair(draft_dir, target_dir, dtype, device)
    # Positions past either model's trained context are refused, not silently extrapolated.
    max_len = min(max_len, d.spec.max_positions, t.spec.max_positions)
    slots = max_batch + max_sessions
    draft = DraftWorker(d.build(packed=packed), slots, max_len, DTYPES[dtype], device)
    if tensor_parallel > 1:
        target = TensorParallelTarget(target_dir, tensor_parallel, slots, max_len, dtype, device)
    else:
        target = TargetWorker(t.build(packed=packed), slots, max_len, DTYPES[dtype], device)
    policy = AutoPolicy(auto_arms) if auto_arms else None
    engine = SpeculativeEngine(
        draft, target, max_batch, max_len, t.spec.vocab_size, max_sessions, policy
    )
    return engine, tokenizer
