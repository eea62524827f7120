"""Token draft: a proposer that reads its tokens only (workers/draft.py has the shared loop).

Its law q(x | prefix) is one fixed conditional law, so the engine feeds it nothing but the
tokens it has not run yet, and it keeps the accepted tokens of each accepted path (τ).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.workers.draft import DraftProposer
from blockspec.workers.llama import Llama
from blockspec.workers.protocols import Draft, PrefillBatch, Target


@dataclass(frozen=True)
class TokenFeed:
    """A token draft's feed (workers/protocols.py, DraftFeed): tokens only."""

    reads_features: bool = False

    def aligned_keep(
        self, draft_keep: int, target_keep: int, prompt_tokens: int
    ) -> tuple[int, int]:
        """Each cache keeps what it can on its own."""
        return draft_keep, target_keep

    def prefill(
        self, draft: Draft, target: Target, batch: PrefillBatch
    ) -> list[torch.Tensor | None]:
        target.prefill(batch.slot0, batch.target_contexts, batch.target_keep)
        draft.prefill(batch.slot0, batch.draft_contexts, batch.draft_keep)
        return [None] * len(batch.draft_contexts)

    def step_inputs(self, pending_features: list, own: list[bool]) -> tuple[None, None]:
        return None, None

    def keeps_own(self, live: bool) -> bool:
        return False  # one law: any step's rows are the law a record was written against

    def kept(self, num_accepted: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        return num_accepted  # every accepted draft token (a plain request's τ is 0)

    def next_features(self, pending, accepted, drafted: bool, own: bool) -> None:
        return None


class TokenDraft(DraftProposer):
    """A draft model without a feature projection."""

    feed = TokenFeed()

    def __init__(
        self, model: Llama, max_batch: int, max_len: int, dtype=torch.float32, device="cpu"
    ):
        if model.feature_fc is not None:
            raise ValueError("a model that reads the target's features is a FeatureDraft")
        super().__init__(model, max_batch, max_len, dtype, device)

    def _pending_features(self, features, own, pending_count) -> None:
        return None

    def _next_features(self, hidden: torch.Tensor) -> None:
        return None

    def _keep_path_state(self, rows, path, keep) -> None:
        """Nothing beside the path's cache entries."""
