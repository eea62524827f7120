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

On CPU (float32 rows) the walk is one compiled loop a request (cpu_verifiers.traversal_walk):
the same segments, with each node's mass summed only when its test is reached. Batched torch
segments cost ~80 dispatched ops and several passes over γ rows each; the loop reads the rows
it tests once. Its sums are float64 where torch's are float32: a test or a draw whose uniform
lies within ~1e-7 (relative) of its threshold could go the other way, nothing else differs.
"""

from __future__ import annotations

import torch

from . import cpu_kernels, cpu_verifiers, kernels
from .block import block_verify_rows
from .common import (
    ALL,
    clipped_products,
    emit,
    host_reads_are_free,
    over_batch_chunks,
    take_rows,
)
from .tensors import sample_from_weights


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


def traversal_verify(
    draft_tokens: torch.Tensor,  # [B, K, γ] int64
    draft_probs: torch.Tensor,  # [B, K, γ, V]
    target_probs: torch.Tensor,  # [B, K, γ+1, V]
    uniforms: torch.Tensor,  # [B, K*γ + 2]
):
    B, K, gamma = draft_tokens.shape
    if K == 1:  # a chain: traversal is exactly block verification (spec §9)
        x = draft_tokens[:, 0]
        tau, y = block_verify_rows(x, draft_probs[:, 0], target_probs[:, 0], uniforms)
        return emit(x, tau, y), tau, torch.zeros_like(tau)
    V = draft_probs.shape[-1]
    dev = draft_tokens.device
    leaves, branch = _leaf_order(draft_tokens)
    p_tok = target_probs[:, :, :gamma].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    q_tok = draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    log_ratio = (p_tok.log() - q_tok.log()).double()  # [B, K, γ] original per-edge ratios
    if host_reads_are_free(draft_tokens) and cpu_kernels.applies(target_probs, draft_probs):
        tau, path, y = cpu_verifiers.traversal_walk(
            draft_tokens, draft_probs, target_probs, leaves, branch, log_ratio, uniforms
        )
        return emit(take_rows(draft_tokens, path), tau, y), tau, path

    # Per-request state; each segment reads and updates the requests still testing (`live`).
    leaf = torch.zeros(B, dtype=torch.int64, device=dev)  # index into `leaves`
    path = leaves[:, 0].clone()
    tests = torch.zeros(B, dtype=torch.int64, device=dev)  # uniforms used so far
    zero = torch.zeros(B, 1, dtype=torch.float64, device=dev)
    log_alpha = torch.cat([zero, clipped_products(take_rows(log_ratio, path))], dim=1)  # [B, γ+1]
    # Rows of branch nodes on the current path that deletions modified (only ancestors of the
    # current leaf ever are; at most one a segment, so these are written sparsely).
    work = torch.promote_types(target_probs.dtype, draft_probs.dtype)  # of α p - q
    mod_p = target_probs.new_empty(B * gamma, V, dtype=work)  # row (request, depth); read only
    mod_q = draft_probs.new_empty(B * gamma, V)  # where `modified`
    modified = torch.zeros(B, gamma, dtype=torch.bool, device=dev)
    tau = torch.full((B,), gamma, dtype=torch.int64, device=dev)
    final_row = target_probs.new_empty(B, V, dtype=work)
    # Rows are read by one index_select over the inputs' merged leading dims: row of (request,
    # path, depth) in flat_p / flat_q.
    flat_p = target_probs.contiguous().view(-1, V)  # [B·K·(γ+1), V]
    flat_q = draft_probs.contiguous().view(-1, V)  # [B·K·γ, V]
    levels = torch.arange(gamma + 1, device=dev)[None, :]
    inner = levels[:, :gamma]
    # Where host reads are free, each segment works on the requests still testing (`live`,
    # compacted). Elsewhere every segment runs on every request, and a request that accepted
    # stays as it was: it repeats its last segment, accepts again and writes the same row.
    # No waits, so the walk can replay from a CUDA graph; both give the same tokens.
    compact = host_reads_are_free(draft_tokens)
    live = torch.arange(B, device=dev)

    def put(t: torch.Tensor, index, value: torch.Tensor, mask: torch.Tensor | None):
        """t with t[index] = value on the rows where mask is set (mask None: every row): t
        itself, written in place, or a new tensor where index is every row (`ALL`)."""
        if mask is not None:
            keep = mask.view(-1, *[1] * (value.dim() - 1))
            if index is ALL:
                return torch.where(keep, value, t)
            value = torch.where(keep, value, t[index])
        t[index] = value
        return t

    def state_rows(idx: torch.Tensor, node: torch.Tensor, d: torch.Tensor):
        """(p, q) rows [n, V] of inner node d (< γ) of each request's current path, as
        deletions left them."""
        is_mod = modified[idx, d, None]
        mod = idx * gamma + d
        p = flat_p.index_select(0, node * (gamma + 1) + d)
        q = flat_q.index_select(0, node * gamma + d)
        return (
            torch.where(is_mod, mod_p.index_select(0, mod), p),
            torch.where(is_mod, mod_q.index_select(0, mod), q),
        )

    inner_p = flat_p.view(B * K, gamma + 1, V)[:, :gamma]  # [B·K, γ, V]: (request, path) rows
    inner_q = flat_q.view(B * K, gamma, V)
    fused = kernels.applies(inner_p, inner_q)  # CUDA: the masses in one pass, rows in place

    def masses(node: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        """Σ_x (α_d p_d - q_d)_+ over the original rows of every inner node: [n, γ]."""
        if fused:
            return kernels.excess_mass(inner_p, inner_q, alpha, rows=node).to(work)
        p = flat_p.index_select(0, (node[:, None] * (gamma + 1) + inner).flatten())
        q = flat_q.index_select(0, (node[:, None] * gamma + inner).flatten())
        p = p.view(-1, gamma, V).mul_(alpha.unsqueeze(-1)).to(work)  # in place: no new pages
        excess = p.sub_(q.view(-1, gamma, V))
        return excess.clamp_min_(0).sum(-1)

    for _ in range(K):  # one segment per distinct leaf; the last one ends at the root (α = 1)
        rows = live if compact else ALL  # every request: views, no gathers
        node = live * K + path[rows]  # [n]: the (request, path) pair of the current leaf
        # [n]: the depth where the next leaf branches off (-1: the last leaf)
        b = branch[rows].gather(1, leaf[rows, None]).squeeze(1)
        # A segment tests the leaf, then each ancestor down to depth b + 1, each after the
        # deletion of its only child updated it. These updates read only the state before the
        # segment (each node is updated once in it), so all of them are one batched pass:
        # R_d = Σ(α_d p_d - q_d)_+,  α'_d = R_d / (R_d + 1 - α_d)  (0/0 -> 1).
        alpha = log_alpha[rows, :gamma].exp().to(target_probs.dtype)  # [n, γ]
        mass = over_batch_chunks(masses, node, alpha, item_numel=2 * gamma * V)
        if compact:
            mod = modified[live].nonzero()  # [m, 2]: (live slot, depth) of modified rows
            if mod.numel():
                slot, d = mod.unbind(1)
                p, q = state_rows(live[slot], node[slot], d)
                mass[slot, d] = (alpha[slot, d, None] * p - q).clamp_min(0).sum(-1)
        else:  # every row's, kept where it is modified
            p, q = mod_p.view(B, gamma, V), mod_q.view(B, gamma, V)
            if fused:
                mod_mass = kernels.excess_mass(p, q, alpha).to(mass.dtype)
            else:
                mod_mass = (alpha.unsqueeze(-1) * p - q).clamp_min(0).sum(-1)
            mass = torch.where(modified, mod_mass, mass)
        denom = mass + 1 - alpha
        new_alpha = torch.where(denom > 0, mass / denom.clamp_min(1e-300), 1.0).clamp_max(1)
        new_log_alpha = new_alpha.double().log()
        test_log_alpha = torch.cat([new_log_alpha, log_alpha[rows, gamma:]], dim=1)  # [n, γ+1]
        # The tests run from depth γ up, each reading the next uniform: depth d reads
        # u[tests + γ - d]. The first to pass (the deepest) is accepted.
        u_index = (tests[rows, None] + gamma - levels).clamp(0, K * gamma)
        passes = (levels > b[:, None]) & (
            uniforms[rows].gather(1, u_index).log() < test_log_alpha
        )  # [n, γ+1]
        accepted = passes.any(1)
        depth = torch.where(passes, levels, -1).amax(1)  # [n]

        # The updated row norm((α p - q)_+) (p if 0/0) of the node each request stops at: the
        # inner node it accepted, or the branch node where its next leaf starts.
        at = torch.where(accepted, depth, b).clamp_max(gamma - 1)
        p, q = state_rows(live, node, at)
        at_mass = mass.gather(1, at[:, None])
        excess = (alpha.gather(1, at[:, None]) * p - q).clamp_min(0)
        new_p = torch.where(at_mass > 0, excess / at_mass.clamp_min(1e-300), p)
        leaf_p = flat_p.index_select(0, node * (gamma + 1) + gamma)  # depth γ: never modified
        emitted = torch.where((depth == gamma)[:, None], leaf_p, new_p)
        if compact:  # the requests that accepted, and those that go on
            done, rest = accepted.nonzero().squeeze(1), (~accepted).nonzero().squeeze(1)
            moved = None  # every request in `rest` moves on
            final_row[live[done]], tau[live[done]] = emitted[done], depth[done]
            if rest.numel() == 0:
                break
        else:
            final_row = torch.where(accepted[:, None], emitted, final_row)
            tau = torch.where(accepted, depth, tau)
            rest, moved = ALL, ~accepted  # every request, in order
        # Not accepted: everything below branch node u is deleted, and u keeps its updated rows
        # (q without the deleted child's token, renormalised: the next child is a draw without
        # replacement); the walk moves to the next leaf below u. (Masked rows compute with
        # u = 0 and write nothing.)
        sw, u_sw, new_p = live[rest], b[rest].clamp_min(0), new_p[rest]
        rows = sw if compact else ALL
        tests = put(tests, rows, tests[rows] + gamma - u_sw, moved)
        tok = draft_tokens[sw, path[rows], u_sw]  # the deleted child's token
        new_q = q[rest].scatter(1, tok[:, None], 0.0)
        q_mass = new_q.sum(-1, keepdim=True)
        new_q = torch.where(q_mass > 0, new_q / q_mass.clamp_min(1e-300), new_q)
        put(mod_p, sw * gamma + u_sw, new_p, moved)
        put(mod_q, sw * gamma + u_sw, new_q, moved)
        # u's row is modified now, rows below it are reset (a tensor value: a Python scalar
        # assigned at tensor indices is copied to the device first, a host wait on CUDA).
        below_u = (modified[rows] & (inner < u_sw[:, None])) | (inner == u_sw[:, None])
        modified = put(modified, rows, below_u, moved)
        u_log_alpha = new_log_alpha[rest].gather(1, u_sw[:, None]).squeeze(1)
        log_alpha = put(log_alpha, (sw, u_sw), u_log_alpha, moved)
        leaf = put(leaf, rows, leaf[rows] + 1, moved)
        path = put(path, rows, leaves[rows].gather(1, leaf[rows, None]).squeeze(1), moved)
        # α along the new path below u: first edge from u's updated rows, then original ratios.
        new_tok = draft_tokens[sw, path[rows], u_sw][:, None]
        first_edge = new_p.gather(1, new_tok).log() - new_q.gather(1, new_tok).log()
        edges = log_ratio[sw, path[rows]]  # [m, γ]
        edges = torch.where(inner == u_sw[:, None], first_edge.double(), edges)
        edges = torch.where(inner >= u_sw[:, None], edges, 0.0)
        refreshed = torch.cat([zero[: sw.numel()], clipped_products(edges, u_log_alpha)], dim=1)
        below = torch.where(levels > u_sw[:, None], refreshed, log_alpha[rows])
        log_alpha = put(log_alpha, rows, below, moved)
        live = sw

    # Each request stopped at the node it accepted: τ is its depth, on its current path.
    y = sample_from_weights(final_row, uniforms[:, K * gamma + 1])
    return emit(take_rows(draft_tokens, path), tau, y), tau, path
