"""GBV: greedy multi-path block verification (Thomas & Pal, arXiv 2602.16961; spec §8).

1. At every tree prefix s rank tokens by the processed ratio p(x|s)/q(x|s), increasing
   (q = 0 -> +inf), ties by increasing id. The same key orders both steps below.
2. Select the path whose tuple of token ranks is lexicographically largest.
3. Skew the draft along that path to the law of "the best of K i.i.d. paths":
   q̃(x | y^l) = [(λ + C(x) + q(x))^K - (λ + C(x))^K] / [(λ + 1)^K - λ^K]
   with C(x) the q-mass ranked below x at y^l and λ_l = L(y^l)/q(y^l) (spec eqs. 25, 28-29,
   divided through by q(y^l)^K), λ_0 = 0, λ_{l+1} = (λ_l + C_l(y_{l+1})) / q_l(y_{l+1}).
4. Block-verify the selected path against p with draft q̃. No carried modification.

The cost is step 3's ranking: a sort of each row by p/q. Block verification needs q̃ at the path
(for p_i and λ: one masked sum per row, no sort), the residual masses R_i of the levels it
tests, and the residual row at τ. On CPU it tests the levels top-down and ranks only the rows
whose level its uniform can pass (_verify_lazily); elsewhere every row is ranked, without host
reads (on CUDA each level's R is summed in rank order by one fused kernel and only the row
at τ is skewed by id, _verify_in_rank_order). Both give the same tokens.

On the numba backend (float32 CPU rows) the whole call (selection, the path's values, the
rounds of levels, the residual draw) runs as numba loops a request (loops.py): the same steps
as _verify_lazily in the same float32 arithmetic, skipping what bounds prove unread.
"""

from __future__ import annotations

import torch

from ..backends import Backend
from ..block import (
    block_tau,
    block_verify,
    block_verify_torch_rows,
    levels_top_down,
    reach_slack,
    residual_token,
    running_products,
)
from ..common import draft_support, emit, over_batch_chunks, support_holding, take_rows
from ..sorting import ascending_order, ratio_key
from ..tensors import cumsum64
from . import kernels, loops


def num_uniforms(k: int, gamma: int) -> int:
    return gamma + 1  # block verification of the selected path


def ranking_key(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """float32 p/q (+inf where q = 0): one key per node, shared by selection and q̃."""
    return ratio_key(p, q).float()


def mass_ranked_below(key: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """C(x) = Σ_{x' ranked below x} q(x') for every token of each row: [N, V] -> [N, V]."""
    order = ascending_order(key)
    q_sorted = q.gather(-1, order)
    return torch.empty_like(q).scatter_(-1, order, (cumsum64(q_sorted) - q_sorted).to(q.dtype))


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


def drafted_mass_below(
    key: torch.Tensor,  # [..., γ, V]: the ranking key of each row
    q: torch.Tensor,  # [..., γ, V]: the draft rows
    x: torch.Tensor,  # [..., γ] int64: the token drafted from each row
    backend: Backend,
) -> torch.Tensor:
    """C(x_i) at each row: the q-mass ranked below the drafted token, [..., γ] in q's dtype.

    One masked float64 sum per row, no sort: λ and q̃(x_i) need C at the path only, and the
    levels that no uniform can pass need no other value of their row (see _verify_lazily).
    On CUDA one kernel (kernels.mass_ranked_below_token) where the torch ops make six passes."""
    if backend.fuses(key, q):
        return kernels.mass_ranked_below_token(key, q, x).to(q.dtype)
    x = x.unsqueeze(-1)
    key_x = key.gather(-1, x)
    ids = torch.arange(key.shape[-1], device=key.device)
    below = (key < key_x) | ((key == key_x) & (ids < x))  # the (key, id) order: ties by id
    return (q * below).sum(-1, dtype=torch.float64).to(q.dtype)


def prefix_lambdas(below_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """λ_0 = 0, λ_{l+1} = (λ_l + C_l(y_{l+1})) / q_l(y_{l+1}): [n, γ] float64 from [n, γ]."""
    below_x, q_x = below_x.double(), q_x.double()
    lam = [torch.zeros_like(q_x[:, 0])]
    for i in range(q_x.shape[1] - 1):
        lam.append((lam[-1] + below_x[:, i]) / q_x[:, i])
    return torch.stack(lam, dim=1)


def skewed_rows(
    q: torch.Tensor,  # [..., V]: draft rows
    p: torch.Tensor,  # [..., V]: the target rows at the same prefixes
    lam: torch.Tensor,  # [...] float64: λ of each prefix
    k: int,
    support: torch.Tensor | None,  # [V'] ids outside which q is 0 (draft_support), or None
    backend: Backend,
) -> torch.Tensor:
    """q̃ of whole rows: each row ranked by (p/q, id), then skewed. [..., V].

    Tokens with q = 0 rank above all others (key +inf) and get q̃ = 0 wherever they stand, so
    on a small draft support only the support is ranked and skewed, bit for bit the same
    values (the support keeps the ids' order, which breaks ties)."""
    if support is not None:
        q_support, p_support = q.index_select(-1, support), p.index_select(-1, support)
        skewed = skewed_rows(q_support, p_support, lam, k, None, backend)
        return q.new_zeros(q.shape).index_copy_(-1, support, skewed)
    V = q.shape[-1]
    key = ranking_key(p, q).view(-1, V)
    if backend.fuses(q, q):  # CUDA: skewed in rank order and written by id, one pass
        return kernels.skewed_rows(q.reshape(-1, V), ascending_order(key), lam, k).view(q.shape)
    below = mass_ranked_below(key, q.reshape(-1, V)).view(q.shape)
    return skewed_probs(q, below, lam, k)


def skewed_draft(
    x: torch.Tensor,  # [n, γ] int64: the selected path
    q: torch.Tensor,  # [n, γ, V]: its draft rows
    p: torch.Tensor,  # [n, γ+1, V]: its target rows
    k: int,
    backend: Backend,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q̃ along the selected path, the law of the best of k i.i.d. draft paths: every row
    [n, γ, V], and q̃(x_i) [n, γ] as the lazy path computes it (from C at the path alone)."""
    below_x, q_x, _ = _path_values(q, p, x, backend)
    lam, q_tilde_x = _skew_at_path(below_x, q_x, k)
    support = support_holding(draft_support(q, backend), x)
    return skewed_rows(q, p[:, : x.shape[1]], lam, k, support, backend), q_tilde_x


def _path_values(
    q: torch.Tensor,  # [n, γ, V]: the path's draft rows
    p: torch.Tensor,  # [n, ≥γ, V]: its target rows
    x: torch.Tensor,  # [n, γ] int64: the path
    backend: Backend,
    key: torch.Tensor | None = None,  # [n, γ, V]: ranking_key of the rows, if computed
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """C, q and p at the path's tokens, [n, γ] each (one masked sum per row, no sort)."""
    p = p[:, : x.shape[1]]
    below_x = drafted_mass_below(ranking_key(p, q) if key is None else key, q, x, backend)
    x = x.unsqueeze(-1)
    return below_x, q.gather(-1, x).squeeze(-1), p.gather(-1, x).squeeze(-1)


def _skew_at_path(below_x: torch.Tensor, q_x: torch.Tensor, k: int):
    """λ [n, γ] float64 of every prefix and q̃(x_i) [n, γ], from C and q at the path."""
    lam = prefix_lambdas(below_x, q_x)
    return lam, skewed_probs(q_x.unsqueeze(-1), below_x.unsqueeze(-1), lam, k).squeeze(-1)


def _verify_all_levels(
    backend: Backend,
    x: torch.Tensor,  # [n, γ] int64: the selected path
    q: torch.Tensor,  # [n, γ, V]: its draft rows
    p: torch.Tensor,  # [n, γ+1, V]: its target rows
    k: int,
    u: torch.Tensor,  # [n, γ+1]
):
    """Every level's residual mass, no host reads (capturable in a CUDA graph). -> τ, y."""
    if backend.fuses(q, q):  # (p has one row more; the kernels read it by its strides)
        return _verify_in_rank_order(x, q, p, k, u, backend)
    q_tilde, q_tilde_x = skewed_draft(x, q, p, k, backend)
    return block_verify_torch_rows(backend, x, q_tilde, p, u, q_drafted=q_tilde_x)


def _verify_in_rank_order(
    x: torch.Tensor,  # [n, γ] int64: the selected path
    q: torch.Tensor,  # [n, γ, V]: its draft rows
    p: torch.Tensor,  # [n, γ+1, V]: its target rows
    k: int,
    u: torch.Tensor,  # [n, γ+1]
    backend: Backend,
):
    """CUDA: _verify_all_levels without the [n, γ, V] rows of q̃. Each level's R sums
    (p_i p - q̃)_+ while walking the row in rank order, where C(x) is a running sum
    (kernels.skewed_excess), and only the row at τ is skewed and written by id. -> τ, y."""
    n, gamma, V = q.shape
    key = ranking_key(p[:, :gamma], q)  # [n, γ, V]: one key for C at the path and the sort
    below_x, q_x, p_x = _path_values(q, p, x, backend, key)
    lam, q_tilde_x = _skew_at_path(below_x, q_x, k)
    pi = running_products(p_x, q_tilde_x, p.dtype)  # [n, γ]
    order = ascending_order(key.view(-1, V)).view(n, gamma, V)
    mass = kernels.skewed_excess(q[:, 1:], p[:, 1:gamma], order[:, 1:], lam[:, 1:], pi[:, :-1], k)
    tau = block_tau(pi, mass.to(pi.dtype), u)
    at_tau = torch.arange(n, device=x.device) * gamma + tau.clamp_max(gamma - 1)  # [n]
    q_row = kernels.skewed_rows(q, order, lam, k, rows=at_tau) * (tau < gamma).unsqueeze(-1)
    return tau, residual_token(pi, tau, take_rows(p, tau), q_row, u[:, gamma])


def _verify_lazily(
    x: torch.Tensor,  # [B, γ] int64: the selected path
    q_all: torch.Tensor,  # [B, K, γ, V]
    p_all: torch.Tensor,  # [B, K, γ+1, V]
    path: torch.Tensor,  # [B] int64: the selected path's index
    k: int,
    u: torch.Tensor,  # [B, γ+1]
    backend: Backend,
):
    """Host backends: block verification that ranks only the rows its
    uniforms reach (levels_top_down: a level i < γ with η_i >= p_i Σp fails unranked, and the
    first pass from the top wins); the same tokens as _verify_all_levels. -> τ [B], y [B].
    p_i and λ need C at the path only (drafted_mass_below). On the benchmark's rows
    (per-token acceptance ~0.6) this ranks ~1.5 of γ = 8 rows per request."""
    B, _, gamma, V = q_all.shape

    def path_values(q_all, p_all, path, x):  # one chunk of requests: copies of its path rows
        return _path_values(take_rows(q_all, path), take_rows(p_all, path), x, backend)

    below_x, q_x, p_x = over_batch_chunks(path_values, q_all, p_all, path, x, item_numel=gamma * V)
    lam, q_tilde_x = _skew_at_path(below_x, q_x, k)
    pi = running_products(p_x, q_tilde_x, p_all.dtype)  # [B, γ]: p_1..p_γ
    support = support_holding(draft_support(q_all, backend), x)

    def rows_at(rows, level):  # the selected path's q̃ and p rows at a level: [m, V] each
        at = (rows, path[rows], level)
        p_at = p_all[at]
        return skewed_rows(q_all[at], p_at, lam[rows, level], k, support, backend), p_at

    q_row = q_all.new_zeros(B, V)  # q̃ after the accepted prefix (zeros when τ = γ)
    tau = levels_top_down(pi, u[:, :gamma], q_row, rows_at, backend)
    p_row = p_all[torch.arange(B, device=x.device), path, tau]
    return tau, residual_token(pi, tau, p_row, q_row, u[:, gamma])


def gbv_verify_loops(
    backend: Backend,
    draft_tokens: torch.Tensor,  # [B, K, γ] int64
    draft_probs: torch.Tensor,  # [B, K, γ, V] float32
    target_probs: torch.Tensor,  # [B, K, γ+1, V] float32
    uniforms: torch.Tensor,  # [B, γ+1]
):
    """The numba backend: the selection, levels and draw as loops a request
    (loops.gbv_verify). -> (tokens, τ, path)."""
    if draft_tokens.shape[1] == 1:  # a single path: q̃ = q exactly, block verification (§8)
        return block_verify(backend, draft_tokens, draft_probs, target_probs, uniforms)
    support, slack = draft_support(draft_probs, backend), reach_slack(target_probs.dtype)
    tau, path, y = loops.gbv_verify(
        draft_tokens, draft_probs, target_probs, uniforms, support, slack
    )
    return emit(take_rows(draft_tokens, path), tau, y), tau, path


def gbv_verify_lazily(
    backend: Backend,
    draft_tokens: torch.Tensor,  # [B, K, γ] int64
    draft_probs: torch.Tensor,  # [B, K, γ, V]
    target_probs: torch.Tensor,  # [B, K, γ+1, V]
    uniforms: torch.Tensor,  # [B, γ+1]
):
    """The torch-host backend: the selected path's levels ranked only where their uniforms
    reach (_verify_lazily). -> (tokens, τ, path)."""
    if draft_tokens.shape[1] == 1:  # a single path: q̃ = q exactly, block verification (§8)
        return block_verify(backend, draft_tokens, draft_probs, target_probs, uniforms)
    path = select_path(draft_tokens, draft_probs, target_probs)
    x = take_rows(draft_tokens, path)  # [B, γ]
    k = draft_tokens.shape[1]
    tau, y = _verify_lazily(x, draft_probs, target_probs, path, k, uniforms, backend)
    return emit(x, tau, y), tau, path


def gbv_verify_all_levels(
    backend: Backend,
    draft_tokens: torch.Tensor,  # [B, K, γ] int64
    draft_probs: torch.Tensor,  # [B, K, γ, V]
    target_probs: torch.Tensor,  # [B, K, γ+1, V]
    uniforms: torch.Tensor,  # [B, γ+1]
):
    """The device backends: every level of the selected path ranked, no host reads
    (_verify_all_levels, over batch chunks). -> (tokens, τ, path)."""
    _, K, gamma, V = draft_probs.shape
    if K == 1:  # a single path: q̃ = q exactly, block verification (§8)
        return block_verify(backend, draft_tokens, draft_probs, target_probs, uniforms)
    path = select_path(draft_tokens, draft_probs, target_probs)
    x = take_rows(draft_tokens, path)  # [B, γ]
    inputs = (target_probs, draft_probs, path, x, uniforms)
    tau, y = over_batch_chunks(_verify_selected, backend, *inputs, K, item_numel=gamma * V)
    return emit(x, tau, y), tau, path


def _verify_selected(
    backend: Backend,
    p_all: torch.Tensor,  # [n, K, γ+1, V]: one chunk of requests
    q_all: torch.Tensor,  # [n, K, γ, V]
    path: torch.Tensor,  # [n] int64: the selected path
    x: torch.Tensor,  # [n, γ] int64: its tokens
    u: torch.Tensor,  # [n, γ+1]
    k: int,
):
    """_verify_all_levels on the selected path's rows of one chunk of requests."""
    q, p = take_rows(q_all, path), take_rows(p_all, path)  # [n, γ, V], [n, γ+1, V]
    return _verify_all_levels(backend, x, q, p, k, u)


def select_path(
    draft_tokens: torch.Tensor,  # [B, K, γ] int64
    draft_probs: torch.Tensor,  # [B, K, γ, V]
    target_probs: torch.Tensor,  # [B, K, γ+1, V]
) -> torch.Tensor:
    """The path [B] whose tuple of token ranks is lexicographically largest (step 2)."""
    B, K, gamma = draft_tokens.shape
    # Paths still tied at depth d share their prefix, so their tokens sit at the same node,
    # where rank order is key order: compare the drafted tokens' keys (ratio, then id)
    # directly, no rank over V needed.
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
    return best.to(torch.int8).argmax(-1)
