"""GBV: greedy multi-path block verification (Thomas & Pal, arXiv 2602.16961; spec §8).

1. At every tree prefix s rank tokens by the processed ratio p(x|s)/q(x|s), increasing
   (q = 0 -> +inf), ties by increasing id. The same key orders both steps below.
2. Select the path whose tuple of token ranks is lexicographically largest.
3. Skew the draft along that path to the law of "the best of K i.i.d. paths":
   q̃(x | y^l) = [(λ + C(x) + q(x))^K - (λ + C(x))^K] / [(λ + 1)^K - λ^K]
   with C(x) the q-mass ranked below x at y^l and λ_l = L(y^l)/q(y^l) (spec eqs. 25, 28-29,
   divided through by q(y^l)^K), λ_0 = 0, λ_{l+1} = (λ_l + C_l(y_{l+1})) / q_l(y_{l+1}).
4. Block-verify the selected path against p with draft q̃. No carried modification.
"""

from __future__ import annotations

import torch

from workers.sampling import cumsum64

from .block import block_verify_rows
from .common import draft_support, emit, over_batch_chunks, take_rows
from .sorting import ascending_order


def num_uniforms(k: int, gamma: int) -> int:
    return gamma + 1  # block verification of the selected path


def ranking_key(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """float32 p/q (+inf where q = 0): one key per node, shared by selection and q̃."""
    inf = torch.inf  # q = 0: p/q is +inf, or NaN where p = 0 too
    return torch.nan_to_num(p / q, nan=inf, posinf=inf, neginf=inf).float()


def mass_ranked_below(key: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """C(x) = Σ_{x' ranked below x} q(x') for every token of each row: [N, V] -> [N, V]."""
    order = ascending_order(key)
    q_sorted = q.gather(-1, order)
    below_sorted = (cumsum64(q_sorted) - q_sorted).to(q.dtype)
    return torch.empty_like(q).scatter_(-1, order, below_sorted)


def _power_sum(a: torch.Tensor, b: torch.Tensor, k: int) -> torch.Tensor:
    """Σ_{j<k} a^j b^{k-1-j}, so that a^k - b^k = (a - b) · this, without cancellation.

    S_1 = 1, S_{n+1} = a S_n + b^n: in place, two temporaries whatever k."""
    if k == 1:
        return torch.ones_like(a)
    total = a + b
    b_pow = b.clone()
    for _ in range(k - 2):
        b_pow.mul_(b)
        total.mul_(a).add_(b_pow)
    return total


def skewed_probs(
    q: torch.Tensor,  # [..., V]
    below: torch.Tensor,  # [..., V]: C(x)
    lam: torch.Tensor,  # [...] float64: λ of the prefix
    k: int,
) -> torch.Tensor:
    """q̃(x | prefix) for every x (or for gathered tokens when the last dim is 1)."""
    inv = (1 / (lam + 1)).to(q.dtype).unsqueeze(-1)  # divide through by (λ+1): no overflow
    t = (lam / (lam + 1)).to(q.dtype).unsqueeze(-1)
    b = torch.addcmul(t, below, inv)
    a = torch.addcmul(b, q, inv)
    return _power_sum(a, b, k).mul_(q).div_(_power_sum(torch.ones_like(t), t, k))


def skewed_draft(
    x: torch.Tensor,  # [n, γ] int64: the selected path
    q: torch.Tensor,  # [n, γ, V]: its draft rows
    p: torch.Tensor,  # [n, γ+1, V]: its target rows
    k: int,
) -> torch.Tensor:
    """q̃ along the selected path, the law of the best of k i.i.d. draft paths: [n, γ, V].

    Tokens with q = 0 rank above all others (key +inf) and get q̃ = 0 wherever they stand, so
    on a small draft support only the support is ranked and skewed, bit for bit the same
    values (the support keeps the ids' order, which breaks ties)."""
    n, gamma, V = q.shape
    support = draft_support(q)
    if support is not None:
        cols = torch.searchsorted(support, x.contiguous()).clamp_max(support.numel() - 1)
        if not bool((support[cols] == x).all()):  # q(x) = 0: an unvalidated, inconsistent call
            support = None
    if support is None:
        return _skewed_on(x, q, p[:, :gamma], k)
    skewed = _skewed_on(
        cols, q.index_select(-1, support), p[:, :gamma].index_select(-1, support), k
    )
    return q.new_zeros(n, gamma, V).index_copy_(-1, support, skewed)


def _skewed_on(
    x: torch.Tensor,  # [n, γ] int64: the path, as column ids of q and p
    q: torch.Tensor,  # [n, γ, V]: its draft rows
    p: torch.Tensor,  # [n, γ, V]: its target rows (not the bonus row)
    k: int,
) -> torch.Tensor:
    n, gamma, V = q.shape
    key = ranking_key(p, q)  # [n, γ, V]: the same key as in the selection
    below = mass_ranked_below(key.view(n * gamma, V), q.reshape(n * gamma, V)).view(n, gamma, V)
    q_x = q.gather(-1, x.unsqueeze(-1)).squeeze(-1).double()  # [n, γ]
    below_x = below.gather(-1, x.unsqueeze(-1)).squeeze(-1).double()
    lam = [torch.zeros(n, dtype=torch.float64, device=q.device)]
    for i in range(gamma - 1):
        lam.append((lam[-1] + below_x[:, i]) / q_x[:, i])
    return skewed_probs(q, below, torch.stack(lam, dim=1), k)


def gbv_verify(
    draft_tokens: torch.Tensor,  # [B, K, γ] int64
    draft_probs: torch.Tensor,  # [B, K, γ, V]
    target_probs: torch.Tensor,  # [B, K, γ+1, V]
    uniforms: torch.Tensor,  # [B, γ+1]
):
    B, K, gamma = draft_tokens.shape
    V = draft_probs.shape[-1]
    # Selection: the lexicographically largest tuple of ranks. Paths still tied at depth d share
    # their prefix, so their tokens sit at the same node, where rank order is key order: compare
    # the drafted tokens' keys (ratio, then id) directly, no rank over V needed.
    tok = draft_tokens.unsqueeze(-1)
    key_y = ranking_key(
        target_probs[:, :, :gamma].gather(-1, tok), draft_probs.gather(-1, tok)
    ).squeeze(-1)
    best = torch.ones(B, K, dtype=torch.bool, device=draft_tokens.device)  # [B, K] still tied
    for d in range(gamma):
        r = torch.where(best, key_y[:, :, d], -1.0)
        top = r.amax(-1, keepdim=True)
        t = torch.where(best & (r == top), draft_tokens[:, :, d], -1)
        best = best & (r == top) & (t == t.amax(-1, keepdim=True))
    path = best.to(torch.int8).argmax(-1)
    x = take_rows(draft_tokens, path)  # [B, γ]
    if K == 1:  # a single path: q̃ = q exactly, GBV is block verification (spec §8)
        tau, y = block_verify_rows(x, draft_probs[:, 0], target_probs[:, 0], uniforms)
        return emit(x, tau, y), tau, path

    def verify_selected(p_all, q_all, path, x, u):  # one chunk of requests
        q, p = take_rows(q_all, path), take_rows(p_all, path)  # [n, γ, V], [n, γ+1, V]
        return block_verify_rows(x, skewed_draft(x, q, p, K), p, u)

    tau, y = over_batch_chunks(
        verify_selected, target_probs, draft_probs, path, x, uniforms, item_numel=gamma * V
    )
    return emit(x, tau, y), tau, path
