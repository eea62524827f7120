"""Speculative engine: continuous batching over a draft worker and a target worker
(workers/protocols.py), in process or over Ray actors (workers/actors.py).

One step for the batch of active requests (docs/architecture.md), with its phases timed
separately (`StepTimes`):
  plan:       the batch's pending tokens, K/γ, sampling settings and groups: one `Step`
  speculate:  draft, tree, target, verify: the step executor the engine is built with runs
              the step (workers/step.py: a `StepRunner` in process, `RemoteRunner` over the
              actors' links, which verifies on the target's rank 0)
  commit:     the draft keeps its accepted tokens; append tokens, retire finished requests

Requests join between steps (`add`) and leave when finished or cancelled (`cancel`); each has
its own method, K, γ, sampling settings, seed and stop conditions. The seed makes the request's
two keys, the draft's and the verifier's: every uniform either draws is a hash of its key, the
step's root position and the number's index (workers/sampling.py, verification.CounterDraws), so
its output does not depend on its batch-mates, and no generator state is kept or shipped.
Method ``none`` is plain autoregressive decoding with the target (the baseline). A mixed batch
runs the draft with the largest K and γ present and each request uses its own prefix of that;
requests with ``none`` still feed their tokens to the draft in such a batch (wasted work, kept
simple), while a batch of only ``none`` requests skips the draft model entirely.
A feature draft (EAGLE; workers/feature_draft.py) also reads the target's features: the target
hands back those of every position it prefills or commits, and each request carries the ones
its draft has not read yet beside its pending tokens. The draft's `feed` (workers/protocols.py)
says what each kind of draft is fed and keeps, so the engine reads the same for both.
Method ``auto`` (service/policy.py) lets the engine's `AutoPolicy` pick each step's method, K
and γ for the batch's auto requests, from the replica's measured step times and acceptance.

Sessions and automatic prefix caching keep finished requests' KV in spare slots
(service/parking.py).
"""

from __future__ import annotations

import itertools
import os
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from blockspec.service.parking import Parked, Parking
from blockspec.service.policy import AUTO, PLAIN, Arm, AutoPolicy, AutoState, StepShape
from blockspec.service.requests import GenerationRequest, Limits, context_needed
from blockspec.service.results import (
    GenerationResult,
    Progress,
    RequestStats,
    StepResult,
    StepTimes,
)
from blockspec.verification import TargetModification
from blockspec.workers.protocols import Draft, PrefillBatch, Target
from blockspec.workers.sampling import draft_key, verify_key
from blockspec.workers.step import (
    Step,
    StepExecutor,
    Verdict,
    VerifyPlan,
    draft_keeps,
    on_device,
)


@dataclass
class _Active:
    req: GenerationRequest
    request_id: str
    verify_key: int  # keys the verifier's uniforms (verification.CounterDraws)
    draft_key: int  # keys the draft's uniforms (workers/sampling.py)
    target_pending: int  # last emitted token: root of the next tree, not yet in target's cache
    draft_pending: list[int]  # emitted tokens not yet run through the draft (1 or 2)
    arm: Arm  # what the next step runs: the request's own, or what `auto` chose for it
    auto: AutoState | None = None  # method auto: what the policy knows of this request
    # feature draft: [len(draft_pending), E], the target's feature before each pending token
    draft_features: torch.Tensor | None = None
    # feature draft: the next step's pending token reads the draft's own feature: the carry
    # holds a live record, whose law it keeps (its own features past the record's root;
    # workers/feature_draft.py), or a speculation cache is on (workers/speculation.py)
    own_features: bool = False
    # feature draft: the first draft cache position written under its own-feature law (None:
    # none). A cold prefill computes every position from the target's features, so a parked
    # draft cache is reusable only up to here (seeded output must not depend on cache hits).
    own_from: int | None = None
    output: list[int] = field(default_factory=list)
    last_emitted: tuple[int, ...] | None = None  # what the last step emitted (speculation key)
    carry: TargetModification | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    emitted: int = 0  # tokens emitted so far, including any past a stop (they are in the caches)
    cached_tokens: int = 0
    # Called with each step's Progress (streaming), on the engine's thread.
    on_tokens: Callable[[Progress], None] | None = field(default=None, repr=False)


class SpeculativeEngine:
    """Workers' caches need max_batch + max_sessions slots: [0, max_batch) for active requests,
    the rest for parked sessions."""

    def __init__(
        self,
        executor: StepExecutor,
        max_batch: int,
        max_len: int,
        vocab_size: int,
        max_sessions: int = 0,
        policy: AutoPolicy | None = None,
        prefix_caching: bool = True,
    ):
        self.executor = executor
        self.draft: Draft = executor.draft
        self.target: Target = executor.target
        # what this kind of draft is fed and keeps (workers/protocols.py)
        self.feed = self.draft.feed
        self.policy = policy or AutoPolicy()
        self.max_batch, self.max_len, self.max_sessions = max_batch, max_len, max_sessions
        self.vocab_size = vocab_size
        self.active: list[_Active] = []  # slot i of both caches belongs to active[i]
        self.waiting: list[_Active] = []
        self.parking = Parking(max_batch, max_sessions, prefix_caching)  # spare slots' KV
        self.times = StepTimes()
        self.steps = 0
        self._ids = itertools.count()

    def reset_stats(self) -> None:
        """Zero the cumulative step counters `times` and `steps` (benchmarks)."""
        self.times, self.steps = StepTimes(), 0

    # ---------------------------------------------------------------- admission
    @property
    def limits(self) -> Limits:
        """What this engine can run: the bounds requests for it are built against
        (service.requests.make_request)."""
        return Limits.for_engine(self.vocab_size, self.max_len)

    def add(
        self,
        req: GenerationRequest,
        request_id: str | None = None,
        on_tokens: Callable[[Progress], None] | None = None,
    ) -> str:
        """Queue a request checked against `limits` (service/requests.py; the engine trusts it)
        under `request_id` (one is made when None); `on_tokens` is called with each step's
        Progress (the tokens it appended to the output; streaming), on the engine's thread,
        once the step is done. Returns the id."""
        request_id = request_id or f"req-{next(self._ids)}"
        seed = req.seed if req.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        keys = verify_key(seed), draft_key(seed)
        last = req.prompt_ids[-1]
        arm, auto, gamma = Arm(req.method, req.k, req.gamma), None, req.gamma
        if req.method == AUTO:
            room = self.max_len - context_needed(len(req.prompt_ids), req.max_new_tokens, AUTO, 0)
            auto, gamma = AutoState(room, req.max_new_tokens), self.policy.max_gamma
        stats = RequestStats(accepted_per_position=[0] * max(gamma, 1))
        active = _Active(
            req, request_id, *keys, last, [last], arm, auto, stats=stats, on_tokens=on_tokens
        )
        self.waiting.append(active)
        return request_id

    def cancel(self, request_id: str, park: bool = True) -> bool:
        """Drop a waiting or active request (between steps). An active one's KV is parked as a
        finished request's is (under its session, or as its scope's prefix): a reply the
        gateway cut at a stop string leaves its prefix to the next turn. `park=False` frees
        it instead (caches that a worker restart emptied)."""
        for i, a in enumerate(self.waiting):
            if a.request_id == request_id:
                del self.waiting[i]
                return True
        for i, a in enumerate(self.active):
            if a.request_id == request_id:
                self._retire(i, park=park)
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
            parked = self.parking.take(a.req)
            if parked is not None:
                kd, kt = parked.reusable(a.req.prompt_ids)
                self.draft.move(parked.slot, slot)
                self.target.move(parked.slot, slot)
                self.parking.release(parked.slot)
            kd, kt = self.feed.aligned_keep(kd, kt, len(a.req.prompt_ids))
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
        what each cache keeps (the draft's feed runs both workers: a feature draft reads the
        target's features of what it prefills); returns the tokens the target prefilled."""
        tokens = [[*a.req.prompt_ids, *a.output] for a in batch]

        def rest(keep: list[int], pending: list[int]) -> list[torch.Tensor]:
            return [
                torch.tensor(t[n : len(t) - p], dtype=torch.int64)
                for t, n, p in zip(tokens, keep, pending, strict=True)
            ]

        draft_pending = [len(a.draft_pending) for a in batch]
        contexts = rest(keep_target, [1] * len(tokens))
        draft_contexts = rest(keep_draft, draft_pending)
        job = PrefillBatch(slot0, contexts, keep_target, draft_contexts, keep_draft, draft_pending)
        for a, features in zip(batch, self.feed.prefill(self.draft, self.target, job), strict=True):
            a.draft_features = features
        return sum(len(c) for c in contexts)

    def _park(self, index: int) -> None:
        """Keep active[index]'s KV in a spare slot: under its session id, or as a cached
        prefix of its scope (which replaces the scope's entries that its history extends)."""
        a = self.active[index]
        key = a.req.session_id or (a.req.cache_scope, a.request_id)
        history = [*a.req.prompt_ids, *a.output]
        slot = self.parking.reserve(a.req, key, history)
        total = len(a.req.prompt_ids) + a.emitted  # what the caches hold, minus pending tokens
        self.draft.move(index, slot)
        self.target.move(index, slot)
        draft_len = min(total - len(a.draft_pending), len(history))
        if a.own_from is not None:
            draft_len = min(draft_len, a.own_from)
        self.parking.entries[key] = Parked(
            slot,
            history,
            draft_len=draft_len,
            target_len=min(total - 1, len(history)),
            scope=None if a.req.session_id else a.req.cache_scope,
        )

    def _retire(self, index: int, park: bool = True) -> None:
        if park and self.parking.wants(self.active[index].req):
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
        draft kept its own features (for a live record, or under the speculation cache's
        own-feature law), a law a rebuild from true features would not reproduce
        (workers/feature_draft.py).

        Both caches are rebuilt, a survivor's too: the failed step may have run on it (the
        draft appends its pending tokens when it proposes). Every active request is prefilled
        again from its own tokens (prompt + output, minus the tokens each cache holds as
        pending); parked sessions are dropped, so a session's next request prefills from the
        history it carries. The failed step changed no request state (carries are set only when
        it returns, and the draws are counters of the root position), so the next step redoes it
        with the same draws."""
        self.executor.restart_lost()
        self.parking.clear()
        lost = [a.request_id for a in self.active if a.own_features]
        for request_id in lost:
            self.cancel(request_id, park=False)  # the restarted workers hold none of its KV
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
        x, verdict, seconds = self.executor.run(plan)
        speculated = time.perf_counter()
        own, kept = draft_keeps(
            self.feed, plan, verdict.num_accepted, verdict.live, self.executor.speculating
        )  # the draft has kept `kept` already: the step's runner commits it
        for a, carry, mine in zip(batch, verdict.carries, own.tolist(), strict=True):
            a.carry = carry
            own_next = self.feed.keeps_own(mine)
            # this step's pending token read its own feature, or its kept path was drafted so
            if a.own_from is None and (a.own_features or own_next):
                a.own_from = len(a.req.prompt_ids) + a.emitted - len(a.draft_pending)
            a.own_features = own_next
        if auto is not None:  # the step's whole wall time: the cost model knows the prefill
            arm, shape = auto
            accepted = verdict.num_accepted.tolist()
            outcomes = [(a.auto, accepted[i]) for i, a in enumerate(batch) if a.auto is not None]
            self.policy.observe(arm, shape, time.perf_counter() - admitting, outcomes)
        finished, streamed = self._advance(plan, x, verdict, kept)
        seconds["overhead"] = planned - start + time.perf_counter() - speculated
        seconds["prefill"] = seconds.get("prefill", 0.0) + prefill  # remote: posted calls
        times = StepTimes(**seconds, batch_size=len(batch))
        for a in batch:
            a.stats.steps.add(times)
        for a, tokens in streamed:  # now that its stats hold the whole step
            stats = a.stats.copy() if a.req.stop else None
            a.on_tokens(Progress(tokens, stats, a.cached_tokens))
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
        fixed = [a.arm for a in batch if a.auto is None]
        shape = StepShape.of(len(batch), fixed, prefilled)
        arm = self.policy.choose(auto, shape)
        for a in batch:
            if a.auto is not None:
                a.arm = arm
        return arm, shape

    def _plan(self, batch: list[_Active]) -> Step:
        plain = [a.arm.method == PLAIN for a in batch]
        pending = features = own = None
        # On the host: the draft reads the counts there (KVCache), and moves them itself.
        counts = torch.tensor([len(a.draft_pending) for a in batch])
        if not all(plain):  # a batch of plain requests never touches the draft model
            width = max(len(a.draft_pending) for a in batch)
            padded = [a.draft_pending + [0] * (width - len(a.draft_pending)) for a in batch]
            pending = on_device(self.draft.device, padded)
            features, own = self.feed.step_inputs(
                [a.draft_features for a in batch], [a.own_features for a in batch]
            )
        # the root's position: what each step's draft uniforms are keyed by, strictly growing
        roots = [len(a.req.prompt_ids) + a.emitted - 1 for a in batch]
        draws = torch.tensor([[a.draft_key, r] for a, r in zip(batch, roots, strict=True)])
        groups = defaultdict(list)
        for i, a in enumerate(batch):
            groups[(a.arm.method, a.arm.k, a.arm.gamma)].append(i)
        return Step(
            request_ids=[a.request_id for a in batch],
            emitted=[a.last_emitted for a in batch],
            num_paths=[0 if pl else a.arm.k for a, pl in zip(batch, plain, strict=True)],
            depth=[0 if pl else a.arm.gamma for a, pl in zip(batch, plain, strict=True)],
            params=[a.req.sampling for a in batch],
            roots=on_device(self.target.device, [a.target_pending for a in batch]),
            pending=pending,
            pending_count=counts,
            draws=draws,
            pending_features=features,
            own_features=own,
            verification=VerifyPlan(
                groups=[(*key, idx) for key, idx in groups.items()],
                carries=[a.carry for a in batch],
                max_gamma=max((a.arm.gamma for a in batch if a.arm.method != PLAIN), default=1),
                draws=torch.tensor([[a.verify_key, r] for a, r in zip(batch, roots, strict=True)]),
            ),
        )

    def _advance(
        self,
        plan: Step,
        x: torch.Tensor,  # [n, K, γ] int64: the step's draft tokens, on the host
        verdict: Verdict,
        kept: torch.Tensor | None,  # [n] int64: draft tokens the draft kept; None: no commit
    ) -> tuple[list[GenerationResult], list[tuple[_Active, list[int]]]]:
        """Append emitted tokens, update pending tokens and stats; retire finished requests.
        Returns the finished requests' results and each streamed request's new tokens."""
        tokens, tau, path = verdict.tokens, verdict.num_accepted, verdict.path
        keep = [0] * len(self.active) if kept is None else kept.tolist()
        done: list[int] = []
        results = []
        streamed = []
        # draft tokens per path that the draft has run
        run = min(plan.verification.max_gamma - 1, x.shape[2])
        for i, a in enumerate(self.active):
            t = int(tau[i])
            emitted = tokens[i, : t + 1].tolist()
            a.stats.count_call(str(a.arm), t)
            a.emitted += len(emitted)
            a.target_pending = emitted[-1]
            a.last_emitted = tuple(emitted)
            if plan.drafted:  # the draft ran the old pending tokens and `committed` path tokens
                committed = min(t, run, keep[i])  # a feature draft: none, unless own_features
                a.draft_pending = [*x[i, int(path[i]), committed:t].tolist(), emitted[-1]]
            else:  # the draft did not run: it still has to see everything since
                a.draft_pending = a.draft_pending + emitted
            # own_features: one pending token, whose feature the draft kept itself (a live
            # record ends inside the path's run part)
            if a.own_features and len(a.draft_pending) != 1:
                raise RuntimeError("a live record outlived its path's drafted tokens")
            accepted = None if verdict.features is None else verdict.features[i, : t + 1]
            a.draft_features = self.feed.next_features(
                a.draft_features, accepted, plan.drafted, a.own_features
            )
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
            if a.on_tokens is not None:
                streamed.append((a, a.output[before:]))
            if reason:
                results.append(
                    GenerationResult(a.request_id, a.output, reason, a.stats, a.cached_tokens)
                )
                done.append(i)
        for i in reversed(done):
            self._retire(i)
        return results, streamed

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Run requests to completion (continuous batching); results in request order."""
        ids = [self.add(r) for r in requests]
        results: dict[str, GenerationResult] = {}
        while self.active or self.waiting:
            for res in self.step().finished:
                results[res.request_id] = res
        return [results[i] for i in ids]
