"""Traversal verification (Weng et al. 2025, arXiv 2505.12398; spec §9).

Bottom-up on the merged draft tree. Every node u has a budget α_u (root 1), a current target
row p_u and draft row q_u. Leaves are tested in post-order DFS (children in first-occurrence
order): accept w.p. α_leaf and emit path(leaf) plus y ~ p_leaf; otherwise delete the leaf and
update its parent u (tok = the deleted child's token):

    R = Σ(α_u p_u - q_u)_+;  p_u <- norm((α_u p_u - q_u)_+);  α_u <- R / (R + 1 - α_u)  (0/0 -> 1);
    q_u <- q_u without tok, renormalised (the next distinct child is a draw without replacement);

then α of u's next subtree is recomputed from the updated u. The root, once a leaf, has α = 1.

All draft leaves sit at depth γ, so the post-order visits distinct paths in lexicographic order
of their (first-occurrence) node ids, and a leaf's ancestors become leaves down to the depth
where it branches off the next leaf. Only nodes on the current root-to-leaf path are ever
modified, so the state is one row per depth.

The walk runs one *segment* per distinct leaf: the leaf's test, then the tests of its
ancestors down to that branch depth b, each right after the deletion of its only child
updated it. Within a segment every node is updated once and from its state before the
segment, so the updates do not depend on the tests' outcomes: all of a segment's masses R are
one batched pass over the path's rows, and its tests compare each node's uniform with its
updated α at once (the deepest pass wins). The sequential order of the paper's walk, and
which uniform each test reads, are unchanged; only the branch node b and the accepted node's
rows are materialised. At most K segments, instead of up to Kγ + 1 single-node steps.

On the numba backend the walk is one compiled loop a request (loops.traversal_walk):
the same segments, with each node's mass summed only when its test is reached. Batched torch
segments cost ~80 dispatched ops and several passes over γ rows each; the loop reads the rows
it tests once. Its sums are float64 where torch's are float32: a test or a draw whose uniform
lies within ~1e-7 (relative) of its threshold could go the other way, nothing else differs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from ..backends import Backend
from ..block import block_verify
from ..common import ALL, clipped_products, emit, over_batch_chunks, take_rows
from ..tensors import sample_from_weights
from . import loops


def num_uniforms(k: int, gamma: int) -> int:
    return k * gamma + 2  # at most one test per tree node plus the root, and one sample


def _leaf_order(draft_tokens: torch.Tensor):
    """Distinct paths in post-order, and the depth at which each branches off the next leaf.

    Returns (leaves [B, K] path ids, distinct ones first; branch [B, K]: depth of the deepest
    node shared with the next leaf, -1 for the last distinct leaf).
    """
    B, K, gamma = draft_tokens.shape
    dev = draft_tokens.device
    same = draft_tokens[:, :, None, :] == draft_tokens[:, None, :, :]  # [B, K, K, γ]
    common = same.long().cumprod(-1).sum(-1)  # [B, K, K] common prefix length
    depth = torch.arange(1, gamma + 1, device=dev)
    # node id of (path k, depth d) = first path sharing its prefix of length d
    node = (common[..., None] >= depth).to(torch.int8).argmax(2)  # [B, K, γ]
    # Lexicographic order of the node-id tuples: two paths first differ at depth c = their
    # common prefix length, where path j precedes path i iff its node id there is smaller.
    at_branch = node.gather(2, common.clamp_max(gamma - 1))  # [B, K(i), K(j)]: node[i, c_ij]
    precedes = (common < gamma) & (at_branch.transpose(1, 2) < at_branch)  # j before i
    distinct = node[:, :, -1] == torch.arange(K, device=dev)  # the first path to its leaf
    # Distinct leaves first, in lexicographic order; duplicates after, by path index.
    rank = precedes.sum(2) * K + torch.arange(K, device=dev) + (~distinct) * (K * K)
    order = rank.argsort(1)
    distinct = distinct.gather(1, order)
    n_leaves = distinct.sum(1)
    nxt = torch.cat([order[:, 1:], order[:, -1:]], dim=1)
    branch = (
        common.gather(1, order.unsqueeze(-1).expand(B, K, K))
        .gather(2, nxt.unsqueeze(-1))
        .squeeze(-1)
    )
    is_last = torch.arange(K, device=dev)[None, :] >= (n_leaves - 1)[:, None]
    return order, torch.where(is_last, -1, branch)


def _log_ratios(
    draft_tokens: torch.Tensor,  # [B, K, γ] int64
    draft_probs: torch.Tensor,  # [B, K, γ, V]
    target_probs: torch.Tensor,  # [B, K, γ+1, V]
) -> torch.Tensor:
    """log p/q of every drafted token, the original per-edge ratios: [B, K, γ] float64."""
    gamma = draft_tokens.shape[2]
    p_tok = target_probs[:, :, :gamma].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    q_tok = draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    return (p_tok.log() - q_tok.log()).double()


def traversal_verify_loops(
    backend: Backend,  # numba
    draft_tokens: torch.Tensor,  # [B, K, γ] int64
    draft_probs: torch.Tensor,  # [B, K, γ, V] float32
    target_probs: torch.Tensor,  # [B, K, γ+1, V] float32
    uniforms: torch.Tensor,  # [B, K*γ + 2]
):
    """The walk as one compiled loop a request (loops.traversal_walk)."""
    if draft_tokens.shape[1] == 1:  # a chain: traversal is exactly block verification (§9)
        return block_verify(backend, draft_tokens, draft_probs, target_probs, uniforms)
    leaves, branch = _leaf_order(draft_tokens)
    log_ratio = _log_ratios(draft_tokens, draft_probs, target_probs)
    tau, path, y = loops.traversal_walk(
        draft_tokens, draft_probs, target_probs, leaves, branch, log_ratio, uniforms
    )
    return emit(take_rows(draft_tokens, path), tau, y), tau, path


def traversal_verify(
    backend: Backend,
    draft_tokens: torch.Tensor,  # [B, K, γ] int64
    draft_probs: torch.Tensor,  # [B, K, γ, V]
    target_probs: torch.Tensor,  # [B, K, γ+1, V]
    uniforms: torch.Tensor,  # [B, K*γ + 2]
):
    """The walk in batched torch segments (the module's docstring): -> (tokens, τ, path)."""
    K, gamma = draft_tokens.shape[1:]
    if K == 1:  # a chain: traversal is exactly block verification (spec §9)
        return block_verify(backend, draft_tokens, draft_probs, target_probs, uniforms)
    walk = _Walk.start(backend, draft_tokens, draft_probs, target_probs, uniforms)
    for _ in range(K):  # one segment per distinct leaf; the last one ends at the root (α = 1)
        if not _segment(walk):
            break
    # Each request stopped at the node it accepted: τ is its depth, on its current path.
    y = sample_from_weights(walk.final_row, uniforms[:, K * gamma + 1])
    return emit(take_rows(draft_tokens, walk.path), walk.tau, y), walk.tau, walk.path


@dataclass
class _Walk:
    """The batched walk: its inputs as flat rows, and each request's state, updated by every
    segment. On the host backends (``compact``) a segment reads and updates the requests still
    testing (``live``, compacted). Elsewhere every segment runs on every request, and a
    request that accepted stays as it was: it repeats its last segment, accepts again and
    writes the same row. No waits, so the walk can replay from a CUDA graph; both give the same
    tokens."""

    draft_tokens: torch.Tensor  # [B, K, γ] int64
    uniforms: torch.Tensor  # [B, K*γ + 2]
    # Rows are read by one index_select over the inputs' merged leading dims: row of
    # (request, path, depth) in flat_p [B·K·(γ+1), V] / flat_q [B·K·γ, V].
    flat_p: torch.Tensor
    flat_q: torch.Tensor
    leaves: torch.Tensor  # [B, K] int64: path ids in post-order (_leaf_order)
    branch: torch.Tensor  # [B, K] int64: where each leaf branches off the next, -1 last
    log_ratio: torch.Tensor  # [B, K, γ] float64: original per-edge log ratios
    compact: bool  # host backends: work on the live requests only
    fused: bool  # the original rows' masses as one Triton pass
    live: torch.Tensor  # [n] int64: the requests still testing (all B where not compact)
    leaf: torch.Tensor  # [B] int64: index into `leaves`
    path: torch.Tensor  # [B] int64: the current leaf's path
    tests: torch.Tensor  # [B] int64: uniforms used so far
    log_alpha: torch.Tensor  # [B, γ+1] float64: log α along the current path
    # Rows of branch nodes on the current path that deletions modified (only ancestors of the
    # current leaf ever are; at most one a segment, so these are written sparsely).
    mod_p: torch.Tensor  # [B·γ, V]: row (request, depth), read only where `modified`
    mod_q: torch.Tensor  # [B·γ, V]
    modified: torch.Tensor  # [B, γ] bool
    tau: torch.Tensor  # [B] int64: the accepted depth
    final_row: torch.Tensor  # [B, V]: the row y is drawn from
    levels: torch.Tensor  # [1, γ+1] int64: the depths 0..γ
    zero: torch.Tensor  # [B, 1] float64: log α at the root

    @staticmethod
    def start(backend, draft_tokens, draft_probs, target_probs, uniforms) -> _Walk:
        """The walk at its first leaf: α along it from the original ratios, nothing modified."""
        B, K, gamma = draft_tokens.shape
        V, dev = draft_probs.shape[-1], draft_tokens.device
        leaves, branch = _leaf_order(draft_tokens)
        log_ratio = _log_ratios(draft_tokens, draft_probs, target_probs)
        path = leaves[:, 0].clone()
        zero = torch.zeros(B, 1, dtype=torch.float64, device=dev)
        log_alpha = torch.cat([zero, clipped_products(take_rows(log_ratio, path))], dim=1)
        work = torch.promote_types(target_probs.dtype, draft_probs.dtype)  # of α p - q
        flat_p = target_probs.contiguous().view(-1, V)
        flat_q = draft_probs.contiguous().view(-1, V)
        inner_p = flat_p.view(B * K, gamma + 1, V)[:, :gamma]  # [B·K, γ, V]: (request, path)
        inner_q = flat_q.view(B * K, gamma, V)
        return _Walk(
            draft_tokens=draft_tokens,
            uniforms=uniforms,
            flat_p=flat_p,
            flat_q=flat_q,
            leaves=leaves,
            branch=branch,
            log_ratio=log_ratio,
            compact=backend.reads_host,
            fused=backend.fuses(inner_p, inner_q),  # the masses in one pass, rows in place
            live=torch.arange(B, device=dev),
            leaf=torch.zeros(B, dtype=torch.int64, device=dev),
            path=path,
            tests=torch.zeros(B, dtype=torch.int64, device=dev),
            log_alpha=log_alpha,
            mod_p=target_probs.new_empty(B * gamma, V, dtype=work),
            mod_q=draft_probs.new_empty(B * gamma, V),
            modified=torch.zeros(B, gamma, dtype=torch.bool, device=dev),
            tau=torch.full((B,), gamma, dtype=torch.int64, device=dev),
            final_row=target_probs.new_empty(B, V, dtype=work),
            levels=torch.arange(gamma + 1, device=dev)[None, :],
            zero=zero,
        )

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.draft_tokens.shape)

    def inner_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The original (p, q) rows of every inner node, by (request, path): [B·K, γ, V]."""
        B, K, gamma = self.shape
        V = self.flat_p.shape[-1]
        return self.flat_p.view(B * K, gamma + 1, V)[:, :gamma], self.flat_q.view(B * K, gamma, V)


def _put(t: torch.Tensor, index, value: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """t with t[index] = value on the rows where mask is set (mask None: every row): t
    itself, written in place, or a new tensor where index is every row (`ALL`)."""
    if mask is not None:
        keep = mask.view(-1, *[1] * (value.dim() - 1))
        if index is ALL:
            return torch.where(keep, value, t)
        value = torch.where(keep, value, t[index])
    t[index] = value
    return t


def _state_rows(
    walk: _Walk,
    idx: torch.Tensor,  # [n] int64: requests
    node: torch.Tensor,  # [n] int64: their (request, path) pairs
    d: torch.Tensor,  # [n] int64: depths < γ
) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, q) rows [n, V] of inner node d of each request's current path, as deletions left
    them."""
    gamma = walk.shape[2]
    is_mod = walk.modified[idx, d, None]
    mod = idx * gamma + d
    p = walk.flat_p.index_select(0, node * (gamma + 1) + d)
    q = walk.flat_q.index_select(0, node * gamma + d)
    return (
        torch.where(is_mod, walk.mod_p.index_select(0, mod), p),
        torch.where(is_mod, walk.mod_q.index_select(0, mod), q),
    )


def _original_masses(
    walk: _Walk,
    node: torch.Tensor,  # [n] int64: (request, path) pairs
    alpha: torch.Tensor,  # [n, γ]
    modified: torch.Tensor | None,  # [n, γ] bool: rows the kernel skips (None: reads all)
) -> torch.Tensor:
    """Σ_x (α_d p_d - q_d)_+ over the original rows of every inner node of the paths `node`:
    [n, γ] in the work dtype (mod_p's); 0 where the kernel skipped a modified row."""
    gamma, V = walk.shape[2], walk.flat_p.shape[-1]
    work = walk.mod_p.dtype
    if walk.fused:
        read = None if modified is None else (modified, False)
        return kernels.excess_mass(*walk.inner_rows(), alpha, rows=node, read=read).to(work)
    inner = walk.levels[:, :gamma]
    p = walk.flat_p.index_select(0, (node[:, None] * (gamma + 1) + inner).flatten())
    q = walk.flat_q.index_select(0, (node[:, None] * gamma + inner).flatten())
    p = p.view(-1, gamma, V).mul_(alpha.unsqueeze(-1)).to(work)  # in place: no new pages
    excess = p.sub_(q.view(-1, gamma, V))
    return excess.clamp_min_(0).sum(-1)


def _segment_masses(walk: _Walk, node: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """R_d = Σ(α_d p_d - q_d)_+ at every inner node of the current paths, on their rows as
    deletions left them: [n, γ]."""
    B, _, gamma = walk.shape
    V = walk.flat_p.shape[-1]
    # The kernel reads each row once: the original where no deletion modified it, else the
    # modified one (every request's rows, where the walk is not compacted).
    modified = walk.modified if walk.fused and not walk.compact else None
    mass = over_batch_chunks(
        _original_masses, walk, node, alpha, modified, item_numel=2 * gamma * V
    )
    if walk.compact:
        mod = walk.modified[walk.live].nonzero()  # [m, 2]: (live slot, depth) of modified rows
        if mod.numel():
            slot, d = mod.unbind(1)
            p, q = _state_rows(walk, walk.live[slot], node[slot], d)
            mass[slot, d] = (alpha[slot, d, None] * p - q).clamp_min(0).sum(-1)
        return mass
    # every row's, kept where it is modified
    p, q = walk.mod_p.view(B, gamma, V), walk.mod_q.view(B, gamma, V)
    if walk.fused:
        mod_mass = kernels.excess_mass(p, q, alpha, read=(walk.modified, True)).to(mass.dtype)
    else:
        mod_mass = (alpha.unsqueeze(-1) * p - q).clamp_min(0).sum(-1)
    return torch.where(walk.modified, mod_mass, mass)


def _segment(walk: _Walk) -> bool:
    """One segment: the current leaf's test, then each ancestor's down to the depth b where
    the next leaf branches off, each after the deletion of its only child updated it. These
    updates read only the state before the segment (each node is updated once in it), so all
    of them are one batched pass: R_d = Σ(α_d p_d - q_d)_+, α'_d = R_d / (R_d + 1 - α_d)
    (0/0 -> 1). The tests run from depth γ up, each reading the next uniform; the first to
    pass (the deepest) is accepted. -> whether any request goes on to a next leaf."""
    K, gamma = walk.shape[1:]
    live = walk.live
    rows = live if walk.compact else ALL  # every request: views, no gathers
    node = live * K + walk.path[rows]  # [n]: the (request, path) pair of the current leaf
    # [n]: the depth where the next leaf branches off (-1: the last leaf)
    b = walk.branch[rows].gather(1, walk.leaf[rows, None]).squeeze(1)
    alpha = walk.log_alpha[rows, :gamma].exp().to(walk.flat_p.dtype)  # [n, γ]
    mass = _segment_masses(walk, node, alpha)
    denom = mass + 1 - alpha
    new_alpha = torch.where(denom > 0, mass / denom.clamp_min(1e-300), 1.0).clamp_max(1)
    new_log_alpha = new_alpha.double().log()
    test_log_alpha = torch.cat([new_log_alpha, walk.log_alpha[rows, gamma:]], dim=1)  # [n, γ+1]
    # Depth d reads u[tests + γ - d].
    levels = walk.levels
    u_index = (walk.tests[rows, None] + gamma - levels).clamp(0, K * gamma)
    passes = (levels > b[:, None]) & (
        walk.uniforms[rows].gather(1, u_index).log() < test_log_alpha
    )  # [n, γ+1]
    accepted = passes.any(1)
    depth = torch.where(passes, levels, -1).amax(1)  # [n]
    # The updated row norm((α p - q)_+) (p if 0/0) of the node each request stops at: the
    # inner node it accepted, or the branch node where its next leaf starts.
    at = torch.where(accepted, depth, b).clamp_max(gamma - 1)
    p, q = _state_rows(walk, live, node, at)
    at_mass = mass.gather(1, at[:, None])
    excess = (alpha.gather(1, at[:, None]) * p - q).clamp_min(0)
    new_p = torch.where(at_mass > 0, excess / at_mass.clamp_min(1e-300), p)
    leaf_p = walk.flat_p.index_select(0, node * (gamma + 1) + gamma)  # depth γ: never modified
    emitted = torch.where((depth == gamma)[:, None], leaf_p, new_p)
    if walk.compact:  # the requests that accepted, and those that go on
        done, rest = accepted.nonzero().squeeze(1), (~accepted).nonzero().squeeze(1)
        moved = None  # every request in `rest` moves on
        walk.final_row[live[done]], walk.tau[live[done]] = emitted[done], depth[done]
        if rest.numel() == 0:
            return False
    else:
        walk.final_row = torch.where(accepted[:, None], emitted, walk.final_row)
        walk.tau = torch.where(accepted, depth, walk.tau)
        rest, moved = ALL, ~accepted  # every request, in order
    u_log_alpha = new_log_alpha[rest].gather(1, b[rest].clamp_min(0)[:, None]).squeeze(1)
    _next_leaf(walk, live[rest], b[rest].clamp_min(0), new_p[rest], q[rest], u_log_alpha, moved)
    return True


def _next_leaf(
    walk: _Walk,
    sw: torch.Tensor,  # [m] int64: the requests that go on
    u_sw: torch.Tensor,  # [m] int64: their branch node's depth u
    new_p: torch.Tensor,  # [m, V]: u's updated target row
    q: torch.Tensor,  # [m, V]: u's draft row before the deletion
    u_log_alpha: torch.Tensor,  # [m] float64: u's updated log α
    moved: torch.Tensor | None,  # [B] bool: who moves, where every request is in sw; None: all
) -> None:
    """Not accepted: everything below branch node u is deleted, and u keeps its updated rows
    (q without the deleted child's token, renormalised: the next child is a draw without
    replacement); the walk moves to the next leaf below u. (Masked rows compute with u = 0
    and write nothing.)"""
    gamma = walk.shape[2]
    rows = sw if walk.compact else ALL
    levels = walk.levels
    inner = levels[:, :gamma]
    walk.tests = _put(walk.tests, rows, walk.tests[rows] + gamma - u_sw, moved)
    tok = walk.draft_tokens[sw, walk.path[rows], u_sw]  # the deleted child's token
    new_q = q.scatter(1, tok[:, None], 0.0)
    q_mass = new_q.sum(-1, keepdim=True)
    new_q = torch.where(q_mass > 0, new_q / q_mass.clamp_min(1e-300), new_q)
    _put(walk.mod_p, sw * gamma + u_sw, new_p, moved)
    _put(walk.mod_q, sw * gamma + u_sw, new_q, moved)
    # u's row is modified now, rows below it are reset (a tensor value: a Python scalar
    # assigned at tensor indices is copied to the device first, a host wait on CUDA).
    below_u = (walk.modified[rows] & (inner < u_sw[:, None])) | (inner == u_sw[:, None])
    walk.modified = _put(walk.modified, rows, below_u, moved)
    walk.log_alpha = _put(walk.log_alpha, (sw, u_sw), u_log_alpha, moved)
    walk.leaf = _put(walk.leaf, rows, walk.leaf[rows] + 1, moved)
    next_path = walk.leaves[rows].gather(1, walk.leaf[rows, None]).squeeze(1)
    walk.path = _put(walk.path, rows, next_path, moved)
    # α along the new path below u: first edge from u's updated rows, then original ratios.
    new_tok = walk.draft_tokens[sw, walk.path[rows], u_sw][:, None]
    first_edge = new_p.gather(1, new_tok).log() - new_q.gather(1, new_tok).log()
    edges = walk.log_ratio[sw, walk.path[rows]]  # [m, γ]
    edges = torch.where(inner == u_sw[:, None], first_edge.double(), edges)
    edges = torch.where(inner >= u_sw[:, None], edges, 0.0)
    refreshed = torch.cat([walk.zero[: sw.numel()], clipped_products(edges, u_log_alpha)], dim=1)
    below = torch.where(levels > u_sw[:, None], refreshed, walk.log_alpha[rows])
    walk.log_alpha = _put(walk.log_alpha, rows, below, moved)
    walk.live = sw
