"""The speculation cache: proposals for the next step prepared before this step's verification
(speculative speculative decoding, SSD / Saguaro, arXiv 2603.03251; vocabulary in
workers/outcomes.py).

After step t's draft, the cache ranks each request's likeliest verification outcomes, the
prefixes x[path, :τ] + [y], from the draft alone (`predict_outcomes`), and drafts step t + 1's
proposal for the `fanout` likeliest in a fork of the draft's state (`DraftProposer.fork`: the
request's committed entries plus the path's τ tokens, then the pending tokens x[path, kept:τ] +
[y]); on a GPU that is work beside the target's pass. At step t + 1 a request whose real
outcome was prepared takes that proposal (a *hit*: its tokens, its rows q and its draft state,
`DraftProposer.adopt`); the others (*misses*) are drafted then: in a fork beside the hits, or
in place, as without a cache, in a step with no hit.

Why it is lossless and seeded output does not change: a proposal is a function of the prefix,
the request's K, γ and sampling settings, and the draft's uniforms, which are counter-based
(workers/sampling.py: a hash of the request's draft key and the step's root position, path and
depth). A proposal prepared for the real prefix is therefore the one the step would draft on
demand, the same bits up to the floating-point reassociation a different batch may bring (as
for batch-mates), and verification sees the rows q it was drawn from. An entry is keyed by
(request id, root position, the emitted prefix, K, γ): the whole history is the request's own
tokens up to the root, so a proposal never serves another prefix (tests/test_speculation.py
has the mutant that does, and the law test that rejects it).

A feature draft (workers/feature_draft.py) reads the target's feature one position back, and
a proposal prepared before verification has none for the tokens that verification accepts. So
while the cache is on, a feature draft drafts under its *own-feature law*: after a step that
rejects (τ < γ), `commit` keeps the accepted path's entries and the draft's own feature at its
end, and the next step's one pending token y reads that feature (as under a live record of
greedy_block and SpecTr-GBV*; `workers.step.draft_keeps` says when);
after a full acceptance it reads the target's features as without a cache, and the cache
prepares no such outcome. Misses and hits draft under the same law, so seeded output does not
depend on hits; it differs from the output without a cache (another draft law, lossless as
any: verification reads the rows q drawn from it), by the acceptance it costs
(docs/outcomes.md).

An entry lives one step. Over Ray the draft actor holds the cache and prepares while the target
shards verify (workers/actors.py: `prepare` is posted right after `propose`). The in-process
engine prepares after drafting, sequentially. On a CPU the draft and the target share the
cores either way, so the cache costs time there and is off by default (`fanout` 0); what a CPU
measures is the hit rate (`hits`, `lookups`). Steps with more drafted requests than
`max_batch` prepare nothing (the policy: see `SpeculationCache`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from blockspec.workers.draft import DraftProposer
from blockspec.workers.outcomes import predict_outcomes
from blockspec.workers.sampling import downweight_top

if TYPE_CHECKING:
    from blockspec.workers.step import Step


@dataclass(frozen=True)
class Proposal:
    """One proposal of a fork: row `row` of its draft tokens and rows."""

    fork: DraftProposer
    row: int
    x: torch.Tensor  # [K, γ] int64
    q: torch.Tensor  # [K, γ, V]
    beliefs: torch.Tensor  # [K, γ, V]: the draft's rows at temperature 1 (DraftProposer)


EntryKey = tuple[str, int, tuple[int, ...], int, int]  # request id, root, prefix, K, γ


class SpeculationCache:
    """Proposals prepared for the likeliest outcomes of the step being verified (module doc)."""

    def __init__(self, fanout: int, max_batch: int | None = None):
        if fanout < 1:
            raise ValueError("speculation: the fan-out must be >= 1")
        self.fanout = fanout
        # The policy: a step with more drafted requests than this prepares nothing (its next
        # step drafts as without a cache). Preparing costs F proposals' draft work per request:
        # hidden behind the target's pass at small batches, it takes the device's throughput
        # from the target at large ones. None: no limit.
        self.max_batch = max_batch
        self.entries: dict[EntryKey, Proposal] = {}
        self.beliefs: torch.Tensor | None = None  # [n, K, γ, V] of the last proposal
        self.hits = 0  # drafted requests whose outcome was prepared
        self.lookups = 0  # drafted requests that looked one up (a step after their first)
        self.prepared = 0  # proposals prepared

    @staticmethod
    def key(request_id: str, root: int, prefix: tuple[int, ...], k: int, gamma: int) -> EntryKey:
        return request_id, root, prefix, k, gamma

    def propose(self, draft: DraftProposer, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's draft tokens [n, K, γ] and rows [n, K, γ, V]: prepared ones where the
        outcome hit, the rest drafted now; the draft's state then holds every request's
        proposal (`adopt`), as after `propose`."""
        draft.keep_beliefs = True  # what `prepare` ranks greedy requests by (forks inherit it)
        roots = step.draws[:, 1].tolist()
        found: dict[int, Proposal] = {}
        for i, rid in enumerate(step.request_ids):
            if step.emitted[i] is None or not step.num_paths[i]:
                continue
            self.lookups += 1
            key = self.key(rid, roots[i], step.emitted[i], step.num_paths[i], step.depth[i])
            if key in self.entries:
                found[i] = self.entries[key]
        self.hits += len(found)
        self.entries = {}
        if not found:  # all drafted now: in place, as without a cache (no fork to copy into)
            x, q = draft.propose(
                step.pending, step.pending_count, step.num_paths, step.depth, step.params,
                step.draws, step.pending_features, own=step.own_features,
            )  # fmt: skip
            self.beliefs = draft.beliefs
            return x, q
        missed = [i for i in range(len(step.request_ids)) if i not in found]
        chosen = dict(found)
        if missed:
            index = torch.tensor(missed)
            pending = step.pending[index.to(step.pending.device)]
            features = own = None
            if step.pending_features is not None:
                features = step.pending_features[index.to(step.pending_features.device)]
            if step.own_features is not None:
                own = step.own_features[index]
            now = self._draft(
                draft, step, missed, None, None, pending, step.pending_count[index],
                step.draws[index], features, own,
            )  # fmt: skip
            chosen.update(zip(missed, now, strict=True))
        rows = [chosen[i] for i in range(len(step.request_ids))]
        parts: dict[int, tuple[DraftProposer, list[int], list[int]]] = {}
        for slot, p in enumerate(rows):
            _, fork_rows, slots = parts.setdefault(id(p.fork), (p.fork, [], []))
            fork_rows.append(p.row)
            slots.append(slot)
        # the step's shape, as `propose` gives it: a fork drafted as wide as its own batch
        k, gamma = max(max(step.num_paths), 1), max(max(step.depth), 1)
        draft.adopt(list(parts.values()), gamma)
        x = _stack([p.x for p in rows])[:, :k, :gamma]
        self.beliefs = _stack([p.beliefs for p in rows])[:, :k, :gamma]
        return x, _stack([p.q for p in rows])[:, :k, :gamma]

    def prepare(
        self,
        draft: DraftProposer,
        step: Step,
        x: torch.Tensor,  # [n, K, γ] int64: the step's draft tokens
        q: torch.Tensor,  # [n, K, γ, V]: their rows
    ) -> None:
        """Draft the next step's proposal for each drafted request's `fanout` likeliest
        outcomes (distinct prefixes), in one fork of the draft's state after this step's
        drafting; they wait in `entries` for the next `propose`."""
        drafted = [i for i, k in enumerate(step.num_paths) if k]
        if not drafted or (self.max_batch is not None and len(drafted) > self.max_batch):
            return
        index = torch.tensor(drafted)
        xs, qs = x[index.to(x.device)], q[index.to(q.device)]
        _, k, gamma = xs.shape
        # the bonus is left out: ranking it needs the draft's row after the whole path, one
        # forward more than the step drafts (blockspec-bench outcomes measures with it)
        residual = qs if draft.downweight is None else residual_estimate(qs, *draft.downweight)
        # a greedy request's rows are one-hot: its recovered token is ranked by the draft's
        # beliefs instead (the target's argmax is likely among the draft's next choices)
        greedy = torch.tensor([step.params[i].temperature == 0 for i in drafted])
        belief = qs  # whose probability of x estimates its acceptance
        if bool(greedy.any()):
            beliefs = self.beliefs[index.to(qs.device)]
            one_hot = greedy.to(qs.device)[:, None, None, None]
            residual = torch.where(one_hot, beliefs, residual)
            belief = torch.where(one_hot, beliefs, qs)
        rows = torch.cat([residual, torch.zeros_like(qs[:, :, :1])], dim=2)  # [n, K, γ+1, V]
        confidence = belief.gather(-1, xs[..., None])[..., 0]  # [n, K, γ]: the estimate of
        # acceptance; entries past a request's own K or γ score nothing
        own = _mask(step, drafted, k, gamma, xs.device)
        ranked = predict_outcomes(xs, rows * own[..., None], confidence, self.fanout * 2)
        keys, roots = step.draws.T.tolist()  # each request's draft key and root position
        tokens = x.tolist()
        own_law = draft.feed.reads_features  # see `speculation_cache`
        slots, hypotheses, paths, keep, pending = [], [], [], [], []
        for b, i in enumerate(drafted):
            own_paths = [tuple(row[: step.depth[i]]) for row in tokens[i][: step.num_paths[i]]]
            taken = 0
            for prefix in ranked[b]:  # likeliest first, each once (predict_outcomes)
                if taken == self.fanout:
                    break
                tau = len(prefix) - 1
                matches = [kk for kk, row in enumerate(own_paths) if row[:tau] == prefix[:-1]]
                if tau > step.depth[i] or not matches:
                    continue  # a padding entry's outcome, not this request's
                if own_law and tau == step.depth[i]:
                    continue  # a full acceptance: the next step reads the target's features
                kept = min(tau, step.depth[i] - 1)  # what commit keeps: the run tokens
                slots.append(i)
                hypotheses.append((i, prefix))
                paths.append(matches[0])  # paths sharing the τ tokens give the same state
                keep.append(kept)
                pending.append(list(prefix[kept:]))
                taken += 1
        if not hypotheses:
            return
        width = max(len(p) for p in pending)
        padded = torch.tensor([p + [0] * (width - len(p)) for p in pending])
        counts = torch.tensor([len(p) for p in pending])
        draws = torch.tensor([[keys[i], roots[i] + len(prefix)] for i, prefix in hypotheses])
        features = own = None
        if own_law:  # the one pending token y reads the draft's own feature at the path's τ
            features = torch.zeros(len(slots), 1, draft.model.spec.hidden_size)
            own = torch.ones(len(slots), dtype=torch.bool)
        proposals = self._draft(draft, step, slots, torch.tensor(paths), torch.tensor(keep),
                                padded.to(draft.device), counts, draws, features, own)  # fmt: skip
        for (i, prefix), proposal in zip(hypotheses, proposals, strict=True):
            key = self.key(step.request_ids[i], roots[i] + len(prefix), prefix,
                           step.num_paths[i], step.depth[i])  # fmt: skip
            self.entries[key] = proposal
        self.prepared += len(proposals)

    @staticmethod
    def _draft(
        draft: DraftProposer,
        step: Step,
        slots: list[int],  # [H]: the batch row (draft slot) each proposal starts from
        path: torch.Tensor | None,  # [H] int64: the path whose first tokens are kept first
        keep: torch.Tensor | None,  # [H] int64: how many (None: an on-demand proposal)
        pending: torch.Tensor,  # [H, P] int64, on the draft's device
        pending_count: torch.Tensor,  # [H] int64, on the host
        draws: torch.Tensor,  # [H, 2] int64
        pending_features: torch.Tensor | None,  # [H, P, E]: feature draft, one back
        own: torch.Tensor | None,  # [H] bool: feature draft, rows reading their own feature
    ) -> list[Proposal]:
        """Proposals drafted in one fork of the draft's state at `slots`, each with its
        slot's K, γ and sampling settings."""
        # One token deeper than any row's γ: a proposal's path entries then hold every one of
        # its own γ tokens, as many as the engine counts as run when a wider batch-mate sets
        # the step's γ (it commits up to min(τ, that γ - 1); `adopt` trims to it). A plain
        # request likewise drafts a token nobody reads: a fork of plain rows has a path.
        paths = [max(step.num_paths[i], 1) for i in slots]
        depths = [max(step.depth[i], 1) + 1 for i in slots]
        fork = draft.fork(slots, room=pending.shape[1] + max(depths))
        if keep is not None:  # the step's path tokens first, as its commit would keep them
            fork.commit(path, keep)
        params = [step.params[i] for i in slots]
        x, q = fork.propose(
            pending, pending_count, paths, depths, params, draws, pending_features, own=own
        )
        rows = zip(x.unbind(0), q.unbind(0), fork.beliefs.unbind(0), strict=True)
        return [Proposal(fork, h, *row) for h, row in enumerate(rows)]


def speculation_cache(
    draft: DraftProposer, fanout: int, downweight: float = 1.0, max_batch: int | None = None
) -> SpeculationCache | None:
    """The speculation cache of fan-out `fanout` for `draft` (None when 0), preparing only at
    batches of at most `max_batch` drafted requests; with `downweight` < 1 the draft samples
    its rows with their `fanout` likeliest tokens scaled by it (Saguaro sampling: a different,
    still lossless draft law whose rejections recover the tokens the cache prepares;
    workers/sampling.downweight_top). A feature draft speculates under its own-feature law
    (module doc): the engine keeps it whenever the cache is on (`speculating`)."""
    if not 0 < downweight <= 1:
        raise ValueError("speculation: downweight must be in (0, 1]")
    draft.downweight = (fanout, downweight) if fanout and downweight < 1 else None
    if not fanout:
        return None
    return SpeculationCache(fanout, max_batch)


def residual_estimate(
    q: torch.Tensor,  # [..., V]: rows a Saguaro draft sampled from (downweight_top)
    count: int,
    factor: float,
) -> torch.Tensor:
    """Where the recovered token is expected after a rejection: the residual (p̂ - q)+ with
    the draft's own row before downweighting standing in for p (its top tokens scaled back up
    by 1 / factor: approximate where the scaling reordered them), normalised; a row whose
    estimate has no mass keeps q. [..., V]."""
    undone = downweight_top(q, count, 1.0 / factor)
    residual = (undone - q).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(1e-30), q)


def _mask(step: Step, rows: list[int], k: int, gamma: int, device) -> torch.Tensor:
    """[n, K, γ+1] 1.0 where row i's path and depth are its own (and its bonus slot), else 0."""
    paths = torch.tensor([step.num_paths[i] for i in rows])[:, None, None]
    depths = torch.tensor([step.depth[i] for i in rows])[:, None, None]
    k_ok = torch.arange(k)[None, :, None] < paths
    g_ok = torch.arange(gamma + 1)[None, None, :] <= depths
    return (k_ok & g_ok).float().to(device)


def _stack(parts: list[torch.Tensor]) -> torch.Tensor:
    """Rows of different K and γ, zero padded to the widest: [n, K, γ, ...]."""
    if all(p.shape == parts[0].shape for p in parts):  # one kind of request: nothing to pad
        return torch.stack(parts)
    shape = [max(p.shape[d] for p in parts) for d in range(parts[0].dim())]
    out = parts[0].new_zeros(len(parts), *shape)
    for i, p in enumerate(parts):
        out[(i, *(slice(0, s) for s in p.shape))] = p
    return out
