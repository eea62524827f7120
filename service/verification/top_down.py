"""Top-down multi-draft verifiers: NSS (§5), SpecInfer RRS (§6), SpecTr K-SEQ (§7).

All three walk the merged tree from the root. At the current node v (depth d) the candidates
are the tokens X_k[d] of the n_v paths that pass through v, in path order (duplicates kept:
they are i.i.d. draws from q(·|v)). A *node rule* produces one token; if it is a child of v the
walk descends (also when the token came from a residual, spec §4), otherwise it is emitted and
the iteration ends. At depth γ the bonus token is drawn from p(·|v).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .common import emit, positive_part_or, sample_from_weights, take_rows

# (p_row [B, V], q_row [B, V], candidates [B, K], is_candidate [B, K], uniforms [B, K+1])
#   -> token [B]
NodeRule = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]


def num_uniforms(k: int, gamma: int) -> int:
    return (gamma + 1) * (k + 1)  # per depth: one per candidate test, one for a residual sample


def walk_tree(
    rule: NodeRule,
    draft_tokens: torch.Tensor,  # [B, K, γ] int64
    draft_probs: torch.Tensor,  # [B, K, γ, V]
    target_probs: torch.Tensor,  # [B, K, γ+1, V]
    uniforms: torch.Tensor,  # [B, (γ+1)(K+1)]
):
    B, K, gamma = draft_tokens.shape
    dev = draft_tokens.device
    u = uniforms.view(B, gamma + 1, K + 1)
    on_path = torch.ones(B, K, dtype=torch.bool, device=dev)  # paths through the current node
    active = torch.ones(B, dtype=torch.bool, device=dev)
    tau = torch.zeros(B, dtype=torch.int64, device=dev)
    last = torch.zeros(B, dtype=torch.int64, device=dev)
    for d in range(gamma + 1):
        first = on_path.to(torch.int8).argmax(-1)  # a path through v: its rows are v's rows
        p_row = take_rows(target_probs[:, :, d], first)
        if d == gamma:
            token = sample_from_weights(p_row, u[:, d, K])  # bonus
        else:
            q_row = take_rows(draft_probs[:, :, d], first)
            token = rule(p_row, q_row, draft_tokens[:, :, d], on_path, u[:, d])
        last = torch.where(active, token, last)
        if d == gamma:
            break
        child = on_path & (draft_tokens[:, :, d] == token[:, None])  # [B, K]
        descends = active & child.any(-1)
        on_path = torch.where(descends[:, None], child, on_path)
        tau = tau + descends.long()
        active = descends
    path = on_path.to(torch.int8).argmax(-1)
    return emit(take_rows(draft_tokens, path), tau, last), tau, path


def naive_rule(p_row, q_row, cand, is_cand, u):
    """NSS: y ~ p(·|v); it continues the walk iff it happens to be a child."""
    return sample_from_weights(p_row, u[:, -1])


def specinfer_rule(p_row, q_row, cand, is_cand, u):
    """Recursive rejection sampling with replacement over the n_v candidates (spec §6).

    Candidate c is accepted w.p. min(1, r(c)/q(c)); on rejection r <- norm((r - q)_+). A
    rejected token keeps residual 0, so its duplicates are rejected too.
    """
    K = cand.shape[1]
    r = p_row
    token = torch.zeros_like(cand[:, 0])
    decided = torch.zeros_like(is_cand[:, 0])
    for k in range(K):
        c = cand[:, k : k + 1]
        testing = is_cand[:, k] & ~decided
        accept = testing & (u[:, k] * q_row.gather(-1, c).squeeze(-1) < r.gather(-1, c).squeeze(-1))
        token = torch.where(accept, c.squeeze(-1), token)
        decided = decided | accept
        rejected = testing & ~accept
        residual = positive_part_or(r - q_row, r)
        r = torch.where(rejected[:, None], residual / residual.sum(-1, keepdim=True), r)
    recovered = sample_from_weights(r, u[:, K])
    return torch.where(decided, token, recovered)


def spectr_rule(p_row, q_row, cand, is_cand, u):
    """K-SEQ with ρ* for k = n_v candidates (spec §7); first acceptance wins."""
    K = cand.shape[1]
    n = is_cand.sum(-1)  # [B] multiplicity of the node
    rho, beta = kseq_rho(p_row, q_row, n)  # [B], [B]
    token = torch.zeros_like(cand[:, 0])
    decided = torch.zeros_like(is_cand[:, 0])
    for k in range(K):
        c = cand[:, k : k + 1]
        accept = (
            is_cand[:, k]
            & ~decided
            & (
                u[:, k] * rho * q_row.gather(-1, c).squeeze(-1).double()
                < p_row.gather(-1, c).squeeze(-1).double()
            )
        )
        token = torch.where(accept, c.squeeze(-1), token)
        decided = decided | accept
    # Residual: p - min(q, p/ρ) (1 - (1-β)^n) / β; β = 0 subtracts nothing.
    accept_mass = 1 - (1 - beta) ** n
    scale = torch.where(beta > 0, accept_mass / beta.clamp_min(1e-300), 0.0).to(p_row.dtype)
    overlap = torch.minimum(q_row, p_row / rho[:, None].to(p_row.dtype))
    residual = positive_part_or(p_row - overlap * scale[:, None], p_row)
    recovered = sample_from_weights(residual, u[:, K])
    return torch.where(decided, token, recovered)


def kseq_rho(p_row: torch.Tensor, q_row: torch.Tensor, n: torch.Tensor, iters: int = 60):
    """Smallest ρ in [1, n] with 1 - (1 - β(ρ))^n <= ρ β(ρ), β(ρ) = Σ min(q, p/ρ). [B] each.

    f(ρ) = ρ β(ρ) - 1 + (1 - β(ρ))^n is nondecreasing; bisection keeps the feasible end, so the
    ρ returned is always feasible (hence lossless) and within (n-1)/2^iters of ρ*. n <= 1 gives
    ρ = 1 (token verification). Computed in float64.
    """
    p = p_row.double()
    q = q_row.double()
    nf = n.double().clamp_min(1)

    def beta(rho: torch.Tensor) -> torch.Tensor:
        return torch.minimum(q, p / rho[:, None]).sum(-1)

    def feasible(rho: torch.Tensor) -> torch.Tensor:
        b = beta(rho)
        return 1 - (1 - b).clamp_min(0) ** nf <= rho * b + 1e-15

    lo = torch.ones_like(nf)
    hi = nf.clone()
    ok_at_one = feasible(lo)
    hi = torch.where(ok_at_one, lo, hi)
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        ok = feasible(mid)
        hi = torch.where(ok, mid, hi)
        lo = torch.where(ok, lo, mid)
        if bool(((hi - lo) <= 1e-13 * hi).all()):
            break
    return hi, beta(hi)
