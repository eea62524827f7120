"""Draft tree construction: merge each request's K paths into a prefix tree, flattened.

Node 0 of every request is its *root*: the last emitted token, not yet in the target's cache.
Node (k, d), d = 1..γ, is the prefix of length d of path k; identical prefixes are one node,
owned by the first path that has it. Nodes are numbered by (depth, owner path), padded to
the batch's largest tree on the CPU, to 1 + Kγ nodes elsewhere (padding sees only itself and
is never read). The target scores every node in one forward pass: node i attends to
node j iff j is an ancestor of i or i itself.

The engine (service/engine.py) builds the trees; the target workers (target.py, actors.py,
tensor_parallel.py) consume them, so they live here, below both. On a GPU a build replays from
a CUDA graph per (batch bucket, K, γ) (`TREE_GRAPHS`): it is ~30 small kernels, each a launch
that costs more than its work.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from blockspec.verification.graphs import VerifyGraphs

# Captured tree builds of this process (any pure batch-first call captures as a verifier's
# does: verification/graphs.py); idle on the CPU. A tree is read within its step, before the
# next build replays: views of the graph's outputs, not copies.
TREE_GRAPHS = VerifyGraphs(copies=False)


@dataclass(frozen=True)
class DraftTree:
    tokens: torch.Tensor  # [n, N] int64: node tokens (root = pending token), 0 on padding
    depth: torch.Tensor  # [n, N] int64: 0 for the root, d for node (k, d); 0 on padding
    mask: torch.Tensor  # [n, N, N] bool: node i sees node j (ancestor-or-self)
    node_of: torch.Tensor  # [n, K, γ+1] int64: node index of the prefix of length d of path k
    num_nodes: torch.Tensor  # [n] int64: real nodes (root included)

    def to(self, device: torch.device) -> DraftTree:
        """The tree on `device` (tensors already there are not copied)."""
        return DraftTree(
            *(getattr(self, f.name).to(device, non_blocking=True) for f in fields(self))
        )


def build_tree(
    root: torch.Tensor, paths: torch.Tensor, num_paths: torch.Tensor, depth: torch.Tensor
) -> DraftTree:
    """root [n] int64; paths [n, K, γ] int64; request b uses paths [0, num_paths[b]) to depth[b]."""
    dev = paths.device
    root, num_paths, depth = (t.to(dev, non_blocking=True) for t in (root, num_paths, depth))
    return DraftTree(*TREE_GRAPHS.run("build_tree", _build, root, paths, num_paths, depth))


def _build(
    root: torch.Tensor,  # [n] int64
    paths: torch.Tensor,  # [n, K, γ] int64
    num_paths: torch.Tensor,  # [n] int64
    depth: torch.Tensor,  # [n] int64
) -> tuple[torch.Tensor, ...]:
    """build_tree's tensors, in DraftTree's order, all on paths' device."""
    n, K, gamma = paths.shape
    dev = paths.device
    ks = torch.arange(K, device=dev)
    ds = torch.arange(1, gamma + 1, device=dev)
    valid = (ks[None, :, None] < num_paths[:, None, None]) & (
        ds[None, None, :] <= depth[:, None, None]
    )  # [n, K, γ]
    same = paths[:, :, None, :] == paths[:, None, :, :]  # [n, K, K', γ]
    common = same.long().cumprod(-1).sum(-1)  # [n, K, K'] shared prefix length
    shares = (common[..., None] >= ds) & (
        ks[None, None, :, None] < num_paths[:, None, None, None]
    )  # [n,K,K',γ]
    owner = shares.to(torch.int8).argmax(2)  # [n, K, γ]: first valid path with the same prefix
    canonical = valid & (owner == ks[None, :, None])
    # Number canonical nodes by (depth, owner path): flatten in depth-major order.
    order = canonical.transpose(1, 2).reshape(n, gamma * K)  # [n, γ·K]
    slot = order.long().cumsum(-1)  # 1-based slot of each canonical node (root is 0)
    slot_of = slot.view(n, gamma, K).transpose(1, 2)  # [n, K, γ] slot if canonical
    node_of = torch.gather(slot_of, 1, owner)  # slot of (owner(k, d), d)
    node_of = torch.where(valid, node_of, 0)
    node_of = torch.cat(
        [torch.zeros(n, K, 1, dtype=torch.int64, device=dev), node_of], dim=2
    )  # [n, K, γ+1]
    num_nodes = 1 + canonical.sum((1, 2))
    # On the CPU the tree is cut to the batch's largest real one (padding nodes cost the target
    # CPU time). Elsewhere every path keeps its nodes (1 + Kγ; the shared ones padding): the
    # real size would be read back from the device, a wait, and a static size is one graph
    # per (K, γ) for the tree pass (workers/graphs.py).
    size = int(num_nodes.max()) if dev.type == "cpu" else 1 + K * gamma

    # Scattered, never indexed by a boolean mask (on a GPU such an index reads the mask back):
    # the entries that are not canonical land on the root's column, which is written last.
    to = torch.where(canonical, slot_of, 0).reshape(n, K * gamma)
    tokens = torch.zeros(n, size, dtype=torch.int64, device=dev)
    node_depth = torch.zeros(n, size, dtype=torch.int64, device=dev)
    tokens.scatter_(1, to, paths.reshape(n, K * gamma))
    node_depth.scatter_(1, to, ds.expand(n, K, gamma).reshape(n, K * gamma))
    tokens[:, 0] = root
    node_depth[:, 0] = 0

    # Ancestors of node (k, d) are (k, d') for d' <= d: scatter the pairs into the mask.
    mask = torch.eye(size, dtype=torch.bool, device=dev).repeat(n, 1, 1)
    anc_valid = torch.cat(
        [torch.ones(n, K, 1, dtype=torch.bool, device=dev), valid], dim=2
    )  # [n, K, γ+1]
    pair_ok = anc_valid[:, :, :, None] & anc_valid[:, :, None, :]
    pair_ok = pair_ok & torch.ones(gamma + 1, gamma + 1, dtype=torch.bool, device=dev).tril()
    i = node_of[:, :, :, None].expand(n, K, gamma + 1, gamma + 1)
    j = node_of[:, :, None, :].expand(n, K, gamma + 1, gamma + 1)
    at = torch.where(pair_ok, i * size + j, 0).reshape(n, -1)  # others: (0, 0), True already
    mask.view(n, size * size).scatter_(1, at, True)
    return tokens, node_depth, mask, node_of, num_nodes
