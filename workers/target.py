"""Target worker: scores every node of every request's draft tree in one forward pass.

The cache holds each request's committed tokens except the last emitted one (the tree's root).
`score` runs the flattened trees (tree attention mask, positions = committed length + depth)
and returns the processed target rows gathered per path; `commit` keeps the root and the
accepted path's entries, so the cache equals a fresh prefill of the accepted sequence.
`prefill` and `commit` return the features (final-norm hidden states) of the positions they
add to the cache: what a feature draft (workers/feature_draft.py) reads next.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from blockspec.verification.tensors import gather_rows
from blockspec.workers.compiled import CompiledForward, compile_forward
from blockspec.workers.draft import prefill, prefill_groups
from blockspec.workers.feature_draft import feed_draft
from blockspec.workers.graphs import ForwardGraphs
from blockspec.workers.llama import KVCache, Llama
from blockspec.workers.protocols import DraftPrefill
from blockspec.workers.sampling import SamplingParams, process
from blockspec.workers.tree import DraftTree


class TargetWorker:
    """The target in this process (workers/protocols.py: a LocalTarget)."""

    def __init__(
        self, model: Llama, max_batch: int, max_len: int, dtype=torch.float32, device="cpu"
    ):
        self.model = model
        self.cache = KVCache(model.spec, model.kv_heads, max_batch, max_len, dtype, device)
        # the decode step's forwards (see use_graphs, use_compiled)
        self.forward: Llama | ForwardGraphs | CompiledForward = model
        self._new: tuple[torch.Tensor, ...] | None = None  # k, v, node_of, features

    @property
    def device(self) -> torch.device:
        """Where the model and cache live; inputs may arrive from anywhere (moved once here)."""
        return self.cache.lengths.device

    def use_graphs(self, emulate: bool = False, compiled: bool = False) -> None:
        """Replay the tree pass from CUDA graphs (workers/graphs.py), of the forward compiled
        by torch.compile with `compiled` (workers/compiled.py). Its outputs are views of the
        graph's own (no copy, a launch each): the rows are processed into new ones, and
        `commit` reads the nodes' keys, values and features before the next tree pass."""
        captured = compile_forward(self.model) if compiled else None
        self.forward = ForwardGraphs(
            self.model, self.cache, emulate, copies=False, captured=captured
        )

    def use_compiled(self) -> None:
        """Run the tree pass through torch.compile (workers/compiled.py)."""
        self.forward = CompiledForward(self.model, self.cache)

    def prefill(
        self, slot0: int, contexts: list[torch.Tensor], keep: list[int] | None = None
    ) -> list[torch.Tensor]:
        """Returns each context's features [T_i, E]."""
        return prefill(self.model, self.cache, slot0, contexts, keep)

    def prefill_groups(
        self, slot0: int, contexts: list[torch.Tensor], keep: list[int] | None = None
    ) -> Iterator[list[torch.Tensor]]:
        """`prefill`, yielding each padding group's features as soon as it is cached."""
        return prefill_groups(self.model, self.cache, slot0, contexts, keep)

    def prefill_features(
        self,
        slot0: int,
        contexts: list[torch.Tensor],
        keep: list[int],
        draft_keep: list[int],
        draft_pending: list[int],
        to_draft: DraftPrefill,
    ) -> list[torch.Tensor]:
        """Prefill for a feature draft: each padding group's draft inputs go to `to_draft` once
        the group is cached. Returns the pending tokens' features [pending_i, E]."""
        groups = self.prefill_groups(slot0, contexts, keep)
        return feed_draft(groups, draft_keep, draft_pending, to_draft)

    def move(self, src: int, dst: int) -> None:
        self.cache.move(src, dst)

    @torch.inference_mode()
    def score(self, tree: DraftTree, params: list[SamplingParams]) -> torch.Tensor:
        """Returns processed target rows [n, K, γ+1, V] along every path (root row at d = 0)."""
        tree = tree.to(self.device)
        return path_rows(self.score_logits(tree), tree, params)

    @torch.inference_mode()
    def score_logits(self, tree: DraftTree) -> torch.Tensor:
        """Raw logits of every tree node [n, N, V]; keeps the nodes' keys/values for commit."""
        tree = tree.to(self.device)
        n = tree.tokens.shape[0]
        positions = self.cache.lengths[:n, None] + tree.depth
        logits, k, v, hidden = self.forward(
            tree.tokens[:, None], positions[:, None], self.cache, tree.mask[:, None]
        )
        self._new = (k[:, :, 0], v[:, :, 0], tree.node_of, hidden[:, 0])
        return logits[:, 0]

    def commit(self, path: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
        """Keep the root and the first num_accepted nodes of each request's accepted path.
        Returns their features [n, γ+1, E] (the first num_accepted + 1 of each row are real)."""
        k, v, node_of, hidden = self._new
        path = path.to(node_of.device, non_blocking=True)
        rows = torch.arange(path.shape[0], device=path.device)
        nodes = node_of[rows, path]  # [n, γ+1]
        self.cache.append(k, v, nodes, num_accepted + 1)  # counts where they arrived: KVCache
        self._new = None
        return hidden[rows[:, None], nodes]


def path_rows(logits: torch.Tensor, tree: DraftTree, params: list[SamplingParams]) -> torch.Tensor:
    """Node logits [n, N, V] -> processed rows per path [n, K, γ+1, V].

    Processing runs once per tree node (shared prefixes once), then rows are gathered per path.
    """
    return gather_rows(process(logits, params), tree.node_of)
