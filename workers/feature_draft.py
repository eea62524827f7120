"""Feature draft (EAGLE; ``Llama.feature_fc``): a proposer that also reads the target's features
(workers/draft.py has the shared loop).

At each position it reads its token and the target's feature (final-norm hidden state) one
position back. Its pending tokens are then all the tokens the target has run since the draft
last ran (the step's emitted tokens), each with the target's feature before it; deeper draft
tokens read the draft's own output in place of the target's feature, so their cache entries are
provisional and `commit` usually keeps none of them (the accepted ones come back as pending
tokens with the target's true features).

A feature draft's law therefore depends on the step that drafts: the same prefix is scored with
the draft's own features when it lies past the step's root, with the target's after a rerun.
Greedy block verification and SpecTr-GBV* write records against the law of the step that
drafted (docs/verification.md, "Carried records with a feature draft"), so while a request
carries a live record its draft keeps that law: `commit` keeps the accepted path's entries
(`keep`) and the draft's own feature at the path's end, and the next `propose` feeds that
feature to the request's one pending token (`own`) instead of the target's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from blockspec.workers.draft import DraftProposer
from blockspec.workers.llama import Llama
from blockspec.workers.protocols import Draft, DraftPrefill, PrefillBatch, Target


@dataclass(frozen=True)
class FeatureFeed:
    """A feature draft's feed (workers/protocols.py, DraftFeed): tokens and the target's
    features, or its own while a request carries a live record."""

    reads_features: bool = True

    def aligned_keep(
        self, draft_keep: int, target_keep: int, prompt_tokens: int
    ) -> tuple[int, int]:
        """The draft keeps one token past the target, or both keep none: a draft position t
        reads the target's feature at t - 1, so the target's new features then cover exactly
        the draft's new positions and the pending token's."""
        target_keep = min(target_keep, draft_keep - 1, prompt_tokens - 2)
        return (target_keep + 1, target_keep) if target_keep >= 0 else (0, 0)

    def prefill(self, draft: Draft, target: Target, batch: PrefillBatch) -> list[torch.Tensor]:
        """The target runs first; the draft prefills each of its padding groups with their
        features (over Ray: while the target runs the next, the features sent actor to actor)."""

        def to_draft(lo: int, hi: int, inputs) -> None:
            slot0, keep = batch.slot0 + lo, batch.draft_keep[lo:hi]
            draft.prefill(slot0, batch.draft_contexts[lo:hi], keep, inputs)

        return target.prefill_features(
            batch.slot0, batch.target_contexts, batch.target_keep, batch.draft_keep,
            batch.draft_pending, to_draft,
        )  # fmt: skip

    def step_inputs(
        self, pending_features: list[torch.Tensor], own: list[bool]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        features = torch.nn.utils.rnn.pad_sequence(pending_features, batch_first=True)
        return features, torch.tensor(own) if any(own) else None

    def keeps_own(self, live: bool) -> bool:
        return live

    def kept(self, num_accepted: torch.Tensor, live: torch.Tensor) -> torch.Tensor | None:
        """A path only under a live record: with none in the batch, nothing (a call over Ray,
        and a pass over the suffix, saved)."""
        if not live.any():
            return None
        return torch.where(live, num_accepted, 0)

    def next_features(
        self,
        pending: torch.Tensor,  # [pending, E]
        accepted: torch.Tensor,  # [τ + 1, E]
        drafted: bool,
        own: bool,
    ) -> torch.Tensor:
        """The target's features before the new pending tokens; under a live record, one
        placeholder row: the request's one pending token reads the draft's own feature."""
        if own:
            return accepted.new_zeros(1, accepted.shape[-1])
        return accepted if drafted else torch.cat([pending, accepted])


class FeatureDraft(DraftProposer):
    """A draft model with a feature projection (``feature_fc``)."""

    feed = FeatureFeed()

    def __init__(
        self, model: Llama, max_batch: int, max_len: int, dtype=torch.float32, device="cpu"
    ):
        if model.feature_fc is None:
            raise ValueError("a model without a feature projection is a TokenDraft")
        super().__init__(model, max_batch, max_len, dtype, device)
        # per slot [slots, E]: the draft's own feature a kept path ended on
        width = model.spec.hidden_size
        self.own_features = torch.zeros(max_batch, width, dtype=dtype, device=device)

    def move(self, src: int, dst: int) -> None:
        super().move(src, dst)
        self.own_features[dst] = self.own_features[src]

    def fork(self, rows: list[int], room: int) -> FeatureDraft:
        """DraftProposer.fork, with the slots' own features and the proposal's own features
        after each depth (what a fork's `commit` keeps: workers/speculation.py)."""
        forked = super().fork(rows, room)
        index = torch.tensor(rows).to(self.device, non_blocking=True)
        forked.own_features = self.own_features.index_select(0, index)
        if self._own_paths is not None:
            forked._own_paths = self._own_paths.index_select(0, index)
        return forked

    def adopt(self, parts: list[tuple[DraftProposer, list[int], list[int]]], gamma: int) -> None:
        """DraftProposer.adopt, with the forks' own features after each depth of their
        proposals (trimmed to the step's γ, as the path entries)."""
        super().adopt(parts, gamma)
        owned = [(f._own_paths, rows, slots) for f, rows, slots in parts]
        n = sum(len(slots) for _, _, slots in parts)
        k = max(paths.shape[1] for paths, _, _ in owned)
        width = self.own_features.shape[1]
        kept = self.own_features.new_zeros(n, k, gamma, width)
        for paths, rows, slots in owned:
            index = torch.tensor(rows).to(self.device, non_blocking=True)
            into = torch.tensor(slots).to(self.device, non_blocking=True)
            depth = min(paths.shape[2], gamma)
            kept[into, : paths.shape[1], :depth] = paths.index_select(0, index)[:, :, :depth]
        self._own_paths = kept

    def _pending_features(
        self,
        features: torch.Tensor,  # [n, P, E] on the device
        own: torch.Tensor | None,  # [n] bool
        pending_count: torch.Tensor,  # [n] int64 on the device
    ) -> torch.Tensor:
        feats = features[:, None]
        if own is None:
            return feats
        # the own feature goes to the last pending token
        steps = torch.arange(features.shape[1], device=self.device)
        last = steps[None, :] == (pending_count - 1)[:, None]  # [n, P]
        own = own.to(self.device, non_blocking=True)
        mine = (last & own[:, None])[:, None, :, None]  # [n, 1, P, 1]
        kept = self.own_features[: features.shape[0], None, None].to(feats.dtype)  # [n,1,1,E]
        return torch.where(mine, kept, feats)

    def _next_features(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def _keep_path_state(self, rows: torch.Tensor, path: torch.Tensor, keep: torch.Tensor) -> None:
        """The own feature at the path's depth keep[i] (the root's when 0)."""
        if self._own_paths is None:
            return
        depth = keep.clamp_max(self._own_paths.shape[2] - 1).to(self.device, non_blocking=True)
        self.own_features[: rows.shape[0]] = self._own_paths[rows, path, depth]
        self._own_paths = None


def split_features(
    features: list[torch.Tensor],  # [T_i, E] each: the target's features of what it prefilled
    keep: list[int],  # [n]: tokens the draft's slot keeps (0: a fresh slot)
    pending: list[int],  # [n]: tokens the draft has yet to run (its next propose runs them)
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A feature draft's position t reads the target's feature at t - 1 (zero at t = 0).
    Returns what the draft's prefill reads ([T_i - pending_i, E], one more row on a fresh
    slot) and the pending tokens' features ([pending_i, E]), which its next propose reads."""
    inputs, tails = [], []
    for f, kept, p in zip(features, keep, pending, strict=True):
        if kept == 0:  # position 0 reads a zero feature
            f = torch.cat([f.new_zeros(1, f.shape[-1]), f])
        inputs.append(f[: len(f) - p])
        tails.append(f[len(f) - p :])
    return inputs, tails


def split_groups(
    groups: Iterable[list[torch.Tensor]],  # per padding group: its features [T_i, E] each
    draft_keep: list[int],  # [n]
    draft_pending: list[int],  # [n]
) -> Iterator[tuple[int, int, list[torch.Tensor], list[torch.Tensor]]]:
    """split_features, a padding group of the target's prefill at a time: yields (lo, hi,
    what the draft's prefill reads of contexts lo..hi, their pending tokens' features)."""
    lo = 0
    for features in groups:
        hi = lo + len(features)
        yield lo, hi, *split_features(features, draft_keep[lo:hi], draft_pending[lo:hi])
        lo = hi


def feed_draft(
    groups: Iterable[list[torch.Tensor]],  # per padding group: its features [T_i, E] each
    draft_keep: list[int],  # [n]
    draft_pending: list[int],  # [n]
    to_draft: DraftPrefill,
) -> list[torch.Tensor]:
    """An in-process target's `prefill_features`: each group's draft inputs to `to_draft`;
    returns the pending tokens' features [pending_i, E]."""
    tails = []
    for lo, hi, inputs, pending in split_groups(groups, draft_keep, draft_pending):
        to_draft(lo, hi, inputs)
        tails += pending
    return tails
