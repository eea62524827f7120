"""Which proposer a draft model gets: a feature draft if it reads the target's features
(``Llama.feature_fc``; workers/feature_draft.py), else a token draft (workers/token_draft.py)."""

from __future__ import annotations

import torch

from blockspec.workers.feature_draft import FeatureDraft
from blockspec.workers.llama import Llama
from blockspec.workers.token_draft import TokenDraft


def build_proposer(
    model: Llama, max_batch: int, max_len: int, dtype=torch.float32, device="cpu"
) -> TokenDraft | FeatureDraft:
    """The draft worker for `model`: its cache of max_batch slots of max_len positions."""
    kind = TokenDraft if model.feature_fc is None else FeatureDraft
    return kind(model, max_batch, max_len, dtype, device)
