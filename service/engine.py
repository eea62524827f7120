"""In-process speculative engine: continuous batching over a draft worker and a target worker.

One step for the batch of active requests (shared/spec/architecture.md):
  draft  -> K i.i.d. paths of γ tokens per request (draft worker)
  tree   -> merge each request's paths into a flattened prefix tree
  target -> one forward over every node of every tree (target worker)
  verify -> per (method, K, γ) group, batched (service.verification)
  commit -> keep the accepted path's KV entries, append tokens, retire finished requests

Requests join between steps (`add`) and leave when finished or cancelled (`cancel`); each has
its own method, K, γ, sampling settings, seed (a private torch.Generator used for both drafting
and verification, so its output does not depend on its batch-mates) and stop conditions.
Method ``none`` is plain autoregressive decoding with the target (the baseline). A mixed batch
runs the draft with the largest K and γ present and each request uses its own prefix of that;
requests with ``none`` still feed their tokens to the draft in such a batch (wasted work, kept
simple), while a batch of only ``none`` requests skips the draft model entirely.

Sessions: a request with a ``session_id`` parks its KV entries in one of ``max_sessions`` spare
cache slots when it finishes (least recently parked evicted first). The session's next request
(its prompt = the history + new tokens) takes the slot back and prefills only the tokens past the
longest cached prefix that still matches; KV of tokens generated past a stop is dropped.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from service.tree import build_tree
from service.verification import VERIFIERS, TargetModification, verify
from workers.draft import DraftWorker
from workers.sampling import SamplingParams, sample
from workers.target import TargetWorker

PLAIN = "none"  # plain target decoding, no speculation


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
class RequestStats:
    target_calls: int = 0
    accepted: int = 0  # draft tokens accepted in all
    accepted_per_position: list[int] = field(default_factory=list)  # [γ]: steps accepting pos i
    # Sums over the steps this request was part of (their time is shared with its batch-mates).
    steps: StepTimes = field(default_factory=lambda: StepTimes())

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
class StepTimes:
    """Wall-clock seconds of engine steps by phase; overhead = bookkeeping and commits;
    transfer = time remote workers' calls took beyond their own compute (zero in-process)."""

    draft: float = 0.0
    tree: float = 0.0
    target: float = 0.0
    transfer: float = 0.0
    verify: float = 0.0
    overhead: float = 0.0
    batch_size: int = 0

    PHASES = ("draft", "tree", "target", "transfer", "verify", "overhead")

    def add(self, other: StepTimes) -> None:
        for name in self.PHASES:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.batch_size += other.batch_size


@dataclass
class _Active:
    req: GenerationRequest
    generator: torch.Generator
    target_pending: int  # last emitted token: root of the next tree, not yet in target's cache
    draft_pending: list[int]  # emitted tokens not yet run through the draft (1 or 2)
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
    ):
        self.draft, self.target = draft, target
        self.max_batch, self.max_len, self.max_sessions = max_batch, max_len, max_sessions
        self.vocab_size = vocab_size
        self.active: list[_Active] = []  # slot i of both caches belongs to active[i]
        self.waiting: list[_Active] = []
        self.parked: OrderedDict[str, _Parked] = OrderedDict()  # oldest first
        self.free_slots = list(range(max_batch + max_sessions - 1, max_batch - 1, -1))
        self.times = StepTimes()
        self.last_step = StepTimes()
        self.steps = 0
        self._ids = itertools.count()

    def reset_stats(self) -> None:
        """Zero the cumulative step counters `times` and `steps` (benchmarks)."""
        self.times, self.steps = StepTimes(), 0

    # ---------------------------------------------------------------- admission
    def validate(self, req: GenerationRequest) -> None:
        """Raise ValueError naming the field of a request the engine cannot serve."""
        if req.method != PLAIN and req.method not in VERIFIERS:
            raise ValueError(
                f"method: unknown {req.method!r}; expected none or one of {', '.join(VERIFIERS)}"
            )
        if not req.prompt_ids:
            raise ValueError("prompt: empty")
        if any(not 0 <= t < self.vocab_size for t in req.prompt_ids):
            raise ValueError(f"prompt: token ids must lie in [0, {self.vocab_size})")
        if req.max_new_tokens < 1:
            raise ValueError("max_new_tokens: must be >= 1")
        if req.method != PLAIN:
            if req.gamma < 1 or req.k < 1:
                raise ValueError("gamma and k: must be >= 1 for speculative methods")
            if VERIFIERS[req.method].single_path and req.k != 1:
                raise ValueError(f"k: method {req.method!r} verifies a single path, k must be 1")
        gamma = req.gamma if req.method != PLAIN else 0
        need = len(req.prompt_ids) + req.max_new_tokens + gamma + 2
        if need > self.max_len:
            raise ValueError(
                f"prompt: {len(req.prompt_ids)} tokens + max_new_tokens + γ exceed the context "
                f"({self.max_len})"
            )

    def add(self, req: GenerationRequest) -> str:
        self.validate(req)
        if not req.request_id:
            req.request_id = f"req-{next(self._ids)}"
        seed = req.seed if req.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        gen = torch.Generator().manual_seed(seed)
        last = req.prompt_ids[-1]
        stats = RequestStats(accepted_per_position=[0] * max(req.gamma, 1))
        self.waiting.append(_Active(req, gen, last, [last], stats=stats))
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

    def _admit(self) -> None:
        room = self.max_batch - len(self.active)
        new, self.waiting = self.waiting[:room], self.waiting[room:]
        if not new:
            return
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
            a.cached_tokens = kt
            keep_draft.append(kd)
            keep_target.append(kt)

        def rest(keep: list[int]) -> list[torch.Tensor]:
            return [
                torch.tensor(a.req.prompt_ids[n:-1], dtype=torch.int64)
                for a, n in zip(new, keep, strict=True)
            ]

        self.draft.prefill(slot0, rest(keep_draft), keep_draft)
        self.target.prefill(slot0, rest(keep_target), keep_target)
        self.active.extend(new)

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

    # ---------------------------------------------------------------- one step
    @torch.inference_mode()
    def step(self) -> list[GenerationResult]:
        """Run one speculative step for every active request; returns requests that finished."""
        self._admit()
        if not self.active:
            return []
        t0 = time.perf_counter()
        act = self.active
        stepped = list(act)  # `act` shrinks as finished requests retire
        n = len(act)
        spec = [a for a in act if a.req.method != PLAIN]
        g_max = max((a.req.gamma for a in spec), default=1)
        params = [a.req.sampling for a in act]
        gens = [a.generator for a in act]

        plain = torch.tensor([a.req.method == PLAIN for a in act])
        num_paths = torch.tensor([a.req.k for a in act]).masked_fill(plain, 0)
        depth = torch.tensor([a.req.gamma for a in act]).masked_fill(plain, 0)
        drafted = bool(spec)  # a batch of plain requests never touches the draft model
        if drafted:
            P = max(len(a.draft_pending) for a in act)
            pending = torch.zeros(n, P, dtype=torch.int64)
            for i, a in enumerate(act):
                pending[i, : len(a.draft_pending)] = torch.tensor(a.draft_pending)
            counts = torch.tensor([len(a.draft_pending) for a in act])
            x, q = self.draft.propose(
                pending, counts, num_paths.tolist(), depth.tolist(), params, gens
            )
        else:
            x = torch.zeros(n, 1, 1, dtype=torch.int64)
        t1 = time.perf_counter()
        root = torch.tensor([a.target_pending for a in act])
        tree = build_tree(root, x, num_paths, depth)
        t2 = time.perf_counter()
        p = self.target.score(tree, params)  # [n, K, γ+1, V]
        t3 = time.perf_counter()

        tokens = torch.full((n, g_max + 1), -1, dtype=torch.int64)
        tau = torch.zeros(n, dtype=torch.int64)
        path = torch.zeros(n, dtype=torch.int64)
        groups = defaultdict(list)
        for i, a in enumerate(act):
            groups[(a.req.method, a.req.k, a.req.gamma)].append(i)
        for (method, k, gamma), idx in groups.items():
            ix = torch.tensor(idx)
            if method == PLAIN:
                tokens[ix, 0] = sample(p[ix, :1, 0], [gens[i] for i in idx])[:, 0]
                continue
            carry = None
            if VERIFIERS[method].modifies_target:
                carry = TargetModification.cat(
                    [act[i].carry or TargetModification.empty(1) for i in idx]
                )
            out = verify(
                method,
                x[ix, :k, :gamma],
                q[ix, :k, :gamma],
                p[ix, :k, : gamma + 1],
                [gens[i] for i in idx],
                carry=carry,
                validate=False,  # rows come from our own processing
            )
            tokens[ix, : gamma + 1] = out.tokens
            tau[ix], path[ix] = out.num_accepted, out.path
            if out.carry is not None:
                for j, i in enumerate(idx):
                    act[i].carry = out.carry.select([j])
        t4 = time.perf_counter()

        if drafted:
            self.draft.commit(path, tau)
        self.target.commit(path, tau)
        finished = self._advance(x, tokens, tau, path, g_max, drafted)
        t5 = time.perf_counter()
        sent_draft, sent_target = _pop_transfer(self.draft), _pop_transfer(self.target)
        step = StepTimes(
            t1 - t0 - sent_draft,
            t2 - t1,
            t3 - t2 - sent_target,
            sent_draft + sent_target,
            t4 - t3,
            t5 - t4,
            n,
        )
        self.last_step = step
        for a in stepped:
            a.stats.steps.add(step)
        self.times.add(step)
        self.steps += 1
        return finished

    def _advance(self, x, tokens, tau, path, g_max, drafted) -> list[GenerationResult]:
        """Append emitted tokens, update pending tokens and stats; retire finished requests."""
        done: list[int] = []
        results = []
        run = min(g_max - 1, x.shape[2])  # draft tokens per path that the draft has run
        for i, a in enumerate(self.active):
            t = int(tau[i])
            emitted = tokens[i, : t + 1].tolist()
            a.stats.target_calls += 1
            a.stats.accepted += t
            a.emitted += len(emitted)
            for pos in range(min(t, len(a.stats.accepted_per_position))):
                a.stats.accepted_per_position[pos] += 1
            a.target_pending = emitted[-1]
            if drafted:  # the draft ran the old pending tokens and `committed` path tokens
                committed = min(t, run) if a.req.method != PLAIN else 0
                a.draft_pending = [*x[i, int(path[i]), committed:t].tolist(), emitted[-1]]
            else:  # the draft did not run: it still has to see everything since
                a.draft_pending = a.draft_pending + emitted
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
            for res in self.step():
                results[res.request_id] = res
        return [results[i] for i in ids]


def _pop_transfer(worker) -> float:
    """Transfer seconds a remote worker proxy (workers.actors) spent since last asked."""
    pop = getattr(worker, "pop_transfer_s", None)
    return pop() if pop is not None else 0.0


def build_engine(
    draft_dir: str,
    target_dir: str,
    max_batch: int = 16,
    max_len: int = 1024,
    dtype: str = "float32",
    device: str = "cpu",
    tensor_parallel: int = 1,
    max_sessions: int = 0,
):
    """Engine over a local draft/target pair; the target split over `tensor_parallel` ranks
    (spawned processes, gloo on CPU) when > 1. `max_len` is capped at the models' context.
    Returns (engine, tokenizer)."""
    from workers.models import DTYPES, load_pair
    from workers.tensor_parallel import TensorParallelTarget

    d, t, tokenizer = load_pair(draft_dir, target_dir, dtype, device)
    # Positions past either model's trained context are refused, not silently extrapolated.
    max_len = min(max_len, d.spec.max_positions, t.spec.max_positions)
    slots = max_batch + max_sessions
    draft = DraftWorker(d.build(), slots, max_len, DTYPES[dtype], device)
    if tensor_parallel > 1:
        target = TensorParallelTarget(target_dir, tensor_parallel, slots, max_len, dtype, device)
    else:
        target = TargetWorker(t.build(), slots, max_len, DTYPES[dtype], device)
    engine = SpeculativeEngine(draft, target, max_batch, max_len, t.spec.vocab_size, max_sessions)
    return engine, tokenizer
