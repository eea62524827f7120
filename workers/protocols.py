"""What the engine (service/engine.py) asks of its workers, as Protocols.

Two sides, each in process or behind Ray actors (workers/actors.py):

- a **draft** (`Draft`): a token draft (workers/token_draft.py) or a feature draft
  (workers/feature_draft.py) in process, or `RemoteDraft`, the proxy of a draft actor holding
  either. Its `feed` (`DraftFeed`) is the host-side half of its kind: what the engine feeds it
  between steps and what it keeps of a step, the same object in process and over Ray.
- a **target** (`Target`): `TargetWorker` (workers/target.py), `TensorParallelTarget`
  (workers/tensor_parallel.py) or `RemoteTarget`, the proxy of the target shard actors.

The engine calls prefill and move on either placement; the rest of a step goes through its step
executor (workers/step.py), chosen once when the engine is built: in process a `StepRunner`
calls `LocalDraft.propose`, `LocalTarget.score` and `LocalTarget.commit`; over Ray it makes one
chained call (`RemoteTarget.speculate`), and the actors run the same runner's two halves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from blockspec.workers.sampling import SamplingParams
from blockspec.workers.tree import DraftTree

# to_draft(lo, hi, inputs): prefill the draft with what it reads of the target's features for
# contexts lo..hi (a list of [T_i, E] tensors, or a Ray reference to one from rank 0)
DraftPrefill = Callable[[int, int, object], None]


@dataclass
class PrefillBatch:
    """Requests joining slots slot0.. of both caches, past what each cache already keeps."""

    slot0: int
    target_contexts: list[torch.Tensor]  # [T_i] int64 each: all but the pending root token
    target_keep: list[int]  # [n]: cached tokens each target slot keeps (0: a fresh slot)
    draft_contexts: list[torch.Tensor]  # [T_i'] int64 each: all but the draft's pending tokens
    draft_keep: list[int]  # [n]: cached tokens each draft slot keeps
    draft_pending: list[int]  # [n]: tokens the draft has yet to run (its next propose runs them)


class Target(Protocol):
    """A target worker as the engine sees it, in process or remote."""

    @property
    def device(self) -> torch.device:
        """Where the worker wants its inputs (a remote one: on the host, for the wire)."""
        ...

    def prefill(
        self, slot0: int, contexts: list[torch.Tensor], keep: list[int] | None = None
    ) -> list[torch.Tensor] | None:
        """Cache contexts ([T_i] int64 each) into slots slot0.. after keep[i] cached tokens;
        in process, returns their features [T_i, E]."""
        ...

    def prefill_features(
        self,
        slot0: int,
        contexts: list[torch.Tensor],  # [T_i] int64 each
        keep: list[int],  # [n]
        draft_keep: list[int],  # [n]: what the feature draft's slots keep
        draft_pending: list[int],  # [n]: the feature draft's pending tokens
        to_draft: DraftPrefill,
    ) -> list[torch.Tensor]:
        """Prefill for a feature draft, one padding group (workers.draft.padding_groups) at a
        time: each group's draft inputs go to `to_draft`. Returns the pending tokens' features
        [pending_i, E], which the requests' next step feeds the draft."""
        ...

    def move(self, src: int, dst: int) -> None:
        """Copy cache slot src into slot dst."""
        ...


class LocalTarget(Target, Protocol):
    """A target in this process: the in-process step executor scores and commits with it."""

    def score(self, tree: DraftTree, params: list[SamplingParams]) -> torch.Tensor:
        """Processed target rows [n, K, γ+1, V] along every path of the step's trees."""
        ...

    def commit(
        self,
        path: torch.Tensor,  # [n] int64: each request's accepted path
        num_accepted: torch.Tensor,  # [n] int64: τ, on the host
    ) -> torch.Tensor:
        """Keep the root and the accepted path's first τ nodes; returns their features
        [n, γ+1, E] (the first τ + 1 of each row are real)."""
        ...


class Draft(Protocol):
    """A draft worker as the engine sees it, in process or remote."""

    @property
    def feed(self) -> DraftFeed:
        """What the engine feeds this kind of draft, and what it keeps of a step."""
        ...

    @property
    def device(self) -> torch.device:
        """Where the worker wants its inputs (a remote one: on the host, for the wire)."""
        ...

    def prefill(
        self,
        slot0: int,
        contexts: list[torch.Tensor],  # [T_i] int64 each
        keep: list[int] | None = None,  # [n]: cached tokens kept per slot; None: 0
        features: list[torch.Tensor] | None = None,  # feature draft: [T_i, E] one position back
    ) -> None:
        """Commit contexts (all but the pending tokens) into slots slot0.. after keep[i]."""
        ...

    def move(self, src: int, dst: int) -> None:
        """Copy cache slot src (and what else the draft keeps per slot) into slot dst."""
        ...


class LocalDraft(Draft, Protocol):
    """A draft in this process (or in its Ray actor): a proposer."""

    def commit(
        self,
        path: torch.Tensor,  # [n] int64: each request's accepted path
        keep: torch.Tensor,  # [n] int64: its draft tokens to keep (DraftFeed.kept), on the host
    ) -> None:
        """Keep the first keep[i] run draft tokens of each request's accepted path."""
        ...

    def propose(
        self,
        pending: torch.Tensor,  # [n, P] int64, padded
        pending_count: torch.Tensor,  # [n] int64 in [1, P], on the host
        paths: list[int],  # [n]: each request's K (0: plain, nothing drafted)
        depths: list[int],  # [n]: each request's γ (0 likewise)
        params: list[SamplingParams],  # [n]
        draws: torch.Tensor,  # [n, 2] int64: (draft key, the step's root position)
        pending_features: torch.Tensor | None = None,  # [n, P, E]: feature draft, one back
        whole_vocab: bool = True,  # False: rows on the head's ids only, [n, K, γ, Vh]
        own: torch.Tensor | None = None,  # [n] bool: feature draft, rows reading their own
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft tokens [n, K, γ] and the processed rows they were drawn from [n, K, γ, V]."""
        ...


class DraftFeed(Protocol):
    """The host-side half of a kind of draft: what the engine feeds it between steps and what
    it keeps of a step. Stateless: a draft actor sends its proposer's to the coordinator."""

    reads_features: bool  # the target hands back the features of what it caches

    def aligned_keep(
        self, draft_keep: int, target_keep: int, prompt_tokens: int
    ) -> tuple[int, int]:
        """The cached prefixes (draft's, target's) a warm session's slots keep, given what each
        cache could keep of a prompt of `prompt_tokens` tokens."""
        ...

    def prefill(
        self, draft: Draft, target: Target, batch: PrefillBatch
    ) -> list[torch.Tensor | None]:
        """Prefill both caches; returns each request's pending features ([pending_i, E], or
        None where the draft reads none)."""
        ...

    def step_inputs(
        self,
        pending_features: list[torch.Tensor | None],  # [n]: [pending_i, E] each
        own: list[bool],  # [n]: the request's draft reads its own kept feature
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """What propose reads beside the pending tokens: features [n, P, E] (padded) and the
        rows that read their own feature [n] bool (None: no row does)."""
        ...

    def keeps_own(self, live: bool) -> bool:
        """Whether a request whose carry holds a live record (`live`) has its draft keep the
        law it drafted with: its path's entries and own feature (docs/verification.md)."""
        ...

    def kept(self, num_accepted: torch.Tensor, live: torch.Tensor) -> torch.Tensor | None:
        """[n] int64: the draft tokens of each accepted path the draft keeps (τ [n], live [n]
        bool, both on the host); None: it keeps nothing of this step (no commit)."""
        ...

    def next_features(
        self,
        pending: torch.Tensor | None,  # [pending, E]: the request's pending features so far
        accepted: torch.Tensor | None,  # [τ + 1, E]: the target's, at the root and accepted
        drafted: bool,  # the draft ran this step (it then ran the old pending tokens)
        own: bool,  # keeps_own: the next propose reads the draft's own feature
    ) -> torch.Tensor | None:
        """A request's pending features after a step (None: the draft reads none)."""
        ...
