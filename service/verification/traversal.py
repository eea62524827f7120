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
"""

from __future__ import annotations

import torch

from workers.sampling import sample_from_weights

from .block import block_verify_rows
from .common import clipped_products, emit, take_rows


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
    order = torch.arange(K, device=dev).expand(B, K)
    for d in reversed(range(gamma)):  # radix sort: lexicographic in (node at depth 1..γ)
        keys = node[:, :, d].gather(1, order)
        order = order.gather(1, torch.sort(keys, dim=1, stable=True).indices)
    distinct = node[:, :, -1].gather(1, order) == order
    order = order.gather(1, torch.sort((~distinct).long(), dim=1, stable=True).indices)
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

    # Per-request state; each step gathers and updates the requests still testing (`live`).
    leaf = torch.zeros(B, dtype=torch.int64, device=dev)  # index into `leaves`
    path = leaves[:, 0].clone()
    depth = torch.full((B,), gamma, dtype=torch.int64, device=dev)  # node under test
    zero = torch.zeros(B, 1, dtype=torch.float64, device=dev)
    log_alpha = torch.cat([zero, clipped_products(take_rows(log_ratio, path))], dim=1)  # [B, γ+1]
    # Rows of nodes on the current path modified by deletions (only ancestors ever are).
    mod_p = target_probs.new_zeros(B, gamma + 1, V)
    mod_q = draft_probs.new_zeros(B, gamma + 1, V)
    modified = torch.zeros(B, gamma + 1, dtype=torch.bool, device=dev)
    final_row = target_probs.new_zeros(B, V)
    flat_p = target_probs.contiguous().view(-1, V)  # [B·K·(γ+1), V]
    flat_q = draft_probs.contiguous().view(-1, V)  # [B·K·γ, V]
    flat_mod_p, flat_mod_q = mod_p.view(-1, V), mod_q.view(-1, V)  # [B·(γ+1), V]
    levels = torch.arange(gamma + 1, device=dev)[None, :]
    live = torch.arange(B, device=dev)

    # Rows are read by one index_select over merged leading dims (flat ids of (request, path,
    # depth) in the inputs, of (request, depth) in mod_*): advanced indexing copies the same
    # rows 2-4x slower on CPU. Not workers.tree.rows_at: its per-call view costs an op a step,
    # and this walk is op-bound.
    def node_rows(idx: torch.Tensor, d: torch.Tensor, read_q: bool):
        """(p, q) rows [n, V] of node d on each request's current path, as modified so far;
        q only when read_q (a parent's: d < γ), else None."""
        is_mod = modified[idx, d, None]
        node, mod = idx * K + path[idx], idx * (gamma + 1) + d
        p = flat_p.index_select(0, node * (gamma + 1) + d)
        p = torch.where(is_mod, flat_mod_p.index_select(0, mod), p)
        if not read_q:
            return p, None
        q = flat_q.index_select(0, node * gamma + d)
        return p, torch.where(is_mod, flat_mod_q.index_select(0, mod), q)

    for step in range(K * gamma + 1):
        d = depth[live]
        accept = uniforms[live, step].log() < log_alpha[live, d]
        done = live[accept]
        final_row[done] = node_rows(done, depth[done], read_q=False)[0]
        live, d = live[~accept], d[~accept]
        if live.numel() == 0:
            break
        # Delete the tested node and update its parent u (the root, α = 1, always accepts).
        parent = d - 1
        p_u, q_u = node_rows(live, parent, read_q=True)
        alpha_u = log_alpha[live, parent].exp().to(p_u.dtype)
        excess = (alpha_u[:, None] * p_u - q_u).clamp_min(0)
        mass = excess.sum(-1)
        new_p = torch.where(mass[:, None] > 0, excess / mass.clamp_min(1e-300)[:, None], p_u)
        denom = mass + 1 - alpha_u
        new_alpha = torch.where(denom > 0, mass / denom.clamp_min(1e-300), 1.0).clamp_max(1)
        tok = draft_tokens[live, path[live], parent]  # the deleted child's token
        new_q = q_u.scatter(1, tok[:, None], 0.0)
        q_mass = new_q.sum(-1, keepdim=True)
        new_q = torch.where(q_mass > 0, new_q / q_mass.clamp_min(1e-300), new_q)
        mod_p[live, parent] = new_p
        mod_q[live, parent] = new_q
        modified[live, parent] = True
        new_log_alpha = new_alpha.double().log()
        log_alpha[live, parent] = new_log_alpha

        # Does u keep another child? Then move to the next leaf below u; else u is next.
        switch = branch[live, leaf[live]] == parent
        depth[live] = torch.where(switch, gamma, parent)
        sw, u_sw = live[switch], parent[switch]
        if sw.numel() == 0:
            continue
        leaf[sw] += 1
        path[sw] = leaves[sw, leaf[sw]]
        below_u = levels > u_sw[:, None]  # [n, γ+1]
        modified[sw] &= ~below_u
        # α along the new path below u: first edge from u's updated rows, then original ratios.
        new_tok = draft_tokens[sw, path[sw], u_sw]
        first_edge = (
            new_p[switch].gather(1, new_tok[:, None]).log()
            - new_q[switch].gather(1, new_tok[:, None]).log()
        )
        edges = log_ratio[sw, path[sw]]  # [n, γ]
        pos = levels[:, :gamma]
        edges = torch.where(pos == u_sw[:, None], first_edge.double(), edges)
        edges = torch.where(pos >= u_sw[:, None], edges, 0.0)
        refreshed = torch.cat(
            [zero[: sw.numel()], clipped_products(edges, new_log_alpha[switch])], dim=1
        )
        log_alpha[sw] = torch.where(below_u, refreshed, log_alpha[sw])

    # Each request stopped at the node it accepted: τ is its depth, on its current path.
    y = sample_from_weights(final_row, uniforms[:, K * gamma + 1])
    return emit(take_rows(draft_tokens, path), depth, y), depth, path
