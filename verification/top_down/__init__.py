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

from ..backends import Backend
from ..common import ALL, draft_support, emit, positive_part_or, take_rows
from ..modification import residual_mass, residual_prob, residual_weights
from ..sorting import ratio_key, sort_ascending
from ..tensors import cumsum64, rows_at, sample_from_weights
from ..token import accepted_length, recovered_token
from . import kernels, loops

# (backend, p_row [B, V], q_row [B, V], candidates [B, K], is_candidate [B, K],
#  uniforms [B, K+1]) -> token [B]
NodeRule = Callable[
    [Backend, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]


# K-SEQ's ρ* search (kseq_rho) splits [lo, hi] into `ways` equal parts per round, for `rounds`
# rounds: 2^32 parts of [1, n] either way, so ρ* lies within (n - 1) 2^-32 < 1e-9 (n - 1) of the
# root, beyond the ~3e-8 precision of float32 rows. The torch ops off the CPU evaluate a row's
# 257 probes in the time of one, so they take few wide rounds (each round is ~25 kernels); on
# CPU every probe costs (the law tests solve ~10^5 rows a call), and on CUDA the kernels sum
# every probe over the row ([16, columns] a step), so these take narrow ones. The CUDA kernels
# stop one round earlier: each round is a pass over the row (the rounds are most of a SpecTr
# call on a GPU), and 2^28 parts put ρ within (n - 1) 2^-28 <= 6e-8 of the root for n <= 17,
# still inside float32's rounding of ρ >= 1. ρ is always a probe where f >= 0, so lossless.
SEARCH_WIDE = (256, 4)  # (ways, rounds): the torch ops off the CPU
SEARCH_NARROW = (16, 8)  # CPU
SEARCH_CUDA = (16, 7)  # the CUDA kernels (kernels.kseq_token)


def num_uniforms(k: int, gamma: int) -> int:
    return (gamma + 1) * (k + 1)  # per depth: one per candidate test, one for a residual sample


def walk_tree(
    rule: NodeRule,
    backend: Backend,
    draft_tokens: torch.Tensor,  # [B, K, γ] int64
    draft_probs: torch.Tensor,  # [B, K, γ, V]
    target_probs: torch.Tensor,  # [B, K, γ+1, V]
    uniforms: torch.Tensor,  # [B, (γ+1)(K+1)]
    single_is_token: bool = False,  # the rule at a one-candidate node is token verification
):
    B, K, gamma = draft_tokens.shape
    dev = draft_tokens.device
    u = uniforms.view(B, gamma + 1, K + 1)
    on_path = torch.ones(B, K, dtype=torch.bool, device=dev)  # paths through the current node
    tau = torch.zeros(B, dtype=torch.int64, device=dev)
    last = torch.zeros(B, dtype=torch.int64, device=dev)
    # Where host reads are free, the walk gathers rows for the requests still walking only
    # (`live`). Elsewhere it walks every request at every depth and masks the finished ones
    # (`walking`): no waits, so the walk can replay from a CUDA graph. Each request reads its
    # own uniforms and rows either way, so both give the same tokens.
    compact = backend.reads_host
    live = torch.arange(B, device=dev)
    walking = torch.ones(B, dtype=torch.bool, device=dev)
    # A node's rows are read by one index_select over the inputs' merged leading dims, from
    # the flat (request, path) index of a path through it.
    V = draft_probs.shape[-1]
    flat_p = target_probs.contiguous().view(-1, V)  # [B·K·(γ+1), V]
    flat_q = draft_probs.contiguous().view(-1, V)  # [B·K·γ, V]
    first_path = live * K  # [B]: the flat index of each request's path 0 (masked walk)
    for d in range(gamma + 1):
        if compact and single_is_token and d < gamma:
            # A node with one path through it stays so below it: the rest of that request's
            # walk is token verification along its path, done for all such requests at once
            # from their scalars p(x), q(x) (only the stopping depth's rows are read).
            alone = on_path[live].sum(-1) == 1
            if bool(alone.any()):
                done = live[alone]
                tau[done], last[done] = _token_from(
                    backend, d, done, on_path[done], draft_tokens, draft_probs, target_probs, u
                )
                live = live[~alone]
                if live.numel() == 0:
                    break
        rows = live if compact else ALL  # every request: views, no gathers
        on_node = on_path[rows]  # [n, K]
        # a path through v, as a flat (request, path) index: v's rows
        node = (live * K if compact else first_path) + on_node.to(torch.int8).argmax(-1)
        p_row = flat_p.index_select(0, torch.add(d, node, alpha=gamma + 1))  # [n, V]
        if d == gamma:
            bonus = sample_from_weights(p_row, u[rows, d, K])
            if compact:
                last[live] = bonus
            else:
                last = torch.where(walking, bonus, last)
            break
        q_row = flat_q.index_select(0, torch.add(d, node, alpha=gamma))
        cand = draft_tokens[rows, :, d]  # [n, K]
        token = rule(backend, p_row, q_row, cand, on_node, u[rows, d])
        child = on_node & (cand == token[:, None])
        descends = child.any(-1)
        if not compact:
            last = torch.where(walking, token, last)
            walking = walking & descends
            on_path = torch.where(walking[:, None], child, on_path)
            tau.add_(walking)
            continue
        last[live] = token
        on_path[live] = torch.where(descends[:, None], child, on_node)
        tau[live] += descends.long()
        live = live[descends]
        if live.numel() == 0:
            break
    path = on_path.to(torch.int8).argmax(-1)
    return emit(take_rows(draft_tokens, path), tau, last), tau, path


def _token_from(
    backend: Backend,
    d: int,  # the depth the requests stand at
    done: torch.Tensor,  # [m] int64: requests with one path through their node
    on_node: torch.Tensor,  # [m, K] bool: that path
    draft_tokens: torch.Tensor,  # [B, K, γ] int64
    draft_probs: torch.Tensor,  # [B, K, γ, V]
    target_probs: torch.Tensor,  # [B, K, γ+1, V]
    u: torch.Tensor,  # [B, γ+1, K+1]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rest of a walk below a one-candidate node, as token verification along its path
    with the uniforms the walk reads (the test of depth d' in column k, the draw in column K):
    -> (τ [m], the last token [m]). The walk's node rule there is TV's test, u q < p, and TV's
    residual (p - q)_+: SpecInfer's level 1 bit for bit, SpecTr's p - min(q, p/ρ)·scale at
    ρ = 1 up to its scale's rounding (1 - (1 - β)) / β."""
    K, gamma = draft_tokens.shape[1:]
    k = on_node.to(torch.int8).argmax(-1, keepdim=True)  # [m, 1]
    b = done.unsqueeze(-1)  # [m, 1]
    depth = torch.arange(d, gamma, device=done.device)  # [L]
    x = draft_tokens[b, k, depth]  # [m, L]
    tau = d + accepted_length(
        target_probs[b, k, depth, x], draft_probs[b, k, depth, x], u[b, depth, k]
    )
    k = k.squeeze(-1)
    if backend.compiled_loops:  # one pass over each row, in place
        return tau, loops.recovered_tokens(target_probs, draft_probs, done, k, tau, u[done, tau, K])
    p_row = rows_at(target_probs, done, k, tau)
    q_row = rows_at(draft_probs, done, k, tau.clamp_max(gamma - 1)) * (tau < gamma).unsqueeze(-1)
    return tau, recovered_token(p_row, q_row, u[done, tau, K])


def naive_verify(
    backend: Backend,
    draft_tokens: torch.Tensor,  # [B, K, γ] int64
    draft_probs: torch.Tensor,  # [B, K, γ, V]
    target_probs: torch.Tensor,  # [B, K, γ+1, V]
    uniforms: torch.Tensor,  # [B, (γ+1)(K+1)]
):
    """NSS (spec §5): the walk with naive_rule at every node."""
    return walk_tree(naive_rule, backend, draft_tokens, draft_probs, target_probs, uniforms)


def specinfer_verify(backend, draft_tokens, draft_probs, target_probs, uniforms):
    """SpecInfer (spec §6): the walk with specinfer_rule (walk_with_token_tails)."""
    inputs = (draft_tokens, draft_probs, target_probs, uniforms)
    return walk_with_token_tails(specinfer_rule, backend, *inputs)


def spectr_verify(backend, draft_tokens, draft_probs, target_probs, uniforms):
    """SpecTr K-SEQ (spec §7): the walk with spectr_rule (walk_with_token_tails)."""
    inputs = (draft_tokens, draft_probs, target_probs, uniforms)
    return walk_with_token_tails(spectr_rule, backend, *inputs)


def walk_with_token_tails(
    rule: NodeRule,  # one whose one-candidate node is token verification
    backend: Backend,
    draft_tokens: torch.Tensor,  # [B, K, γ] int64
    draft_probs: torch.Tensor,  # [B, K, γ, V]
    target_probs: torch.Tensor,  # [B, K, γ+1, V]
    uniforms: torch.Tensor,  # [B, (γ+1)(K+1)]
):
    """The verifier of a rule whose one-candidate node is token verification (SpecInfer and
    SpecTr: spec §6, §7): at K = 1 it runs TV over the whole path at once (_token_from at the
    root), with the uniforms the walk would read, so the same seeds give the same tokens
    without a per-depth walk. At K > 1 the walk on the host backends hands a request to TV the
    same way once one path is left through its node."""
    B, K, gamma = draft_tokens.shape
    inputs = (draft_tokens, draft_probs, target_probs)
    if K > 1:
        return walk_tree(rule, backend, *inputs, uniforms, single_is_token=True)
    everyone = torch.arange(B, device=draft_tokens.device)
    one_path = torch.ones(B, 1, dtype=torch.bool, device=draft_tokens.device)
    u = uniforms.view(B, gamma + 1, 2)  # [B, γ+1, K+1]
    tau, y = _token_from(backend, 0, everyone, one_path, *inputs, u)
    return emit(draft_tokens[:, 0], tau, y), tau, torch.zeros_like(tau)


def naive_rule(backend, p_row, q_row, cand, is_cand, u):
    """NSS: y ~ p(·|v); it continues the walk iff it happens to be a child."""
    return sample_from_weights(p_row, u[:, -1])


def specinfer_rule(backend, p_row, q_row, cand, is_cand, u):
    """Recursive rejection sampling with replacement over the n_v candidates (spec §6).

    Candidate c is accepted w.p. min(1, r(c)/q(c)); on rejection r <- norm((r - q)_+). A
    rejected token keeps residual 0 (up to rounding), so its duplicates are rejected too.

    The residual after j rejections does not depend on which tokens were rejected, and it has
    a closed form: r_0 = p and r_j = (p - t_j q)_+ / z_j, where z_j is that row's mass,
    t_1 = 1 and t_{j+1} = t_j + z_j, since (r_j - q)_+ > 0 exactly where p > (t_j + z_j) q.
    So every test reads two scalars per row and its candidate's p and q, and the only passes
    over the vocabulary are one mass per level and the recovered row (the loop kept every
    level's whole row: seven passes a candidate).

    Where host reads are free (CPU), level j is computed only if some row is still rejecting
    when it is reached, and the recovered row only if some row rejected every candidate: the
    first candidate is usually accepted, and then no level's pass over the vocabulary is
    needed. Elsewhere every level is computed without waiting on the host; both give the
    same tokens. On CUDA the levels, the tests and the draw are K + 2 kernels
    (kernels.rrs_token), the same sums in the same chunks as the torch ops' row_masses.
    """
    if backend.fuses(p_row, q_row):  # CUDA: the levels, tests and draw as K + 2 kernels
        return kernels.rrs_token(p_row, q_row, cand, is_cand, u)
    n, K = cand.shape
    # At least float32 rows: t grows past 1, and in bfloat16 1 + z_1 rounds back to 1 once
    # z_1 < 2^-8 (level 2 would repeat level 1). No copy for float32 rows.
    work = torch.promote_types(torch.promote_types(p_row.dtype, q_row.dtype), torch.float32)
    p_row, q_row = p_row.to(work), q_row.to(work)
    lazy = backend.reads_host
    level = is_cand.long().cumsum(-1) - is_cand.long()  # [n, K]: candidates tested before
    n_v = is_cand.sum(-1)  # [n]
    p_c, q_c = p_row.gather(-1, cand).double(), q_row.gather(-1, cand).double()  # [n, K]
    uq_c = u[:, :K].double() * q_c
    t = [torch.zeros(n, dtype=torch.float64, device=p_row.device)]  # level 0: r_0 = p itself
    z = [torch.ones_like(t[0])]

    def tests():  # [n, K]: the tests of the candidates whose level is known, at once
        known = len(t) - 1  # levels 0..known (a candidate's level is at most K - 1)
        at = level if known >= K - 1 else level.clamp_max(known)
        t_c, z_c = torch.stack(t, -1).gather(-1, at), torch.stack(z, -1).gather(-1, at)
        passed = is_cand & (uq_c < residual_prob(p_c, q_c, t_c, z_c))
        return passed if known >= K - 1 else passed & (level <= known)

    for j in range(1, K + 1):  # level j: the residual after j rejections
        # A row reads level j if it rejected its first j candidates: for a (j+1)-th test or
        # for its recovered token. Candidates past a row's first acceptance do not matter.
        if lazy:
            accept = tests()
            if not bool((~accept.any(-1) & (n_v >= j)).any()):
                break
        t_next = t[-1] + z[-1]
        mass = residual_mass(backend, p_row, q_row, t_next)
        empty = mass <= 0  # no mass left (a probability-0 branch): the row stays as it was
        t.append(torch.where(empty, t[-1], t_next))
        z.append(torch.where(empty, z[-1], mass))
    else:  # every level computed: test at them all
        accept = tests()
    first = accept.to(torch.int8).argmax(-1, keepdim=True)  # the first accepted candidate
    token = cand.gather(-1, first).squeeze(-1)
    accepted = accept.any(-1)
    if lazy and bool(accepted.all()):
        return token
    # All n_v rejected: sample level n_v's residual (unnormalised weights sample alike).
    t_rejected = torch.stack(t, -1).gather(-1, n_v.clamp_max(len(t) - 1).unsqueeze(-1))
    recovered = sample_from_weights(residual_weights(p_row, q_row, t_rejected.squeeze(-1)), u[:, K])
    return torch.where(accepted, token, recovered)


def spectr_rule(backend, p_row, q_row, cand, is_cand, u):
    """K-SEQ with ρ* for k = n_v candidates (spec §7); first acceptance wins."""
    if backend.fuses(p_row, q_row):  # CUDA: the search, tests and draw as kernels, no sort
        return kernels.kseq_token(p_row, q_row, cand, is_cand, u, SEARCH_CUDA)[0]
    n = is_cand.sum(-1)  # [B] multiplicity of the node
    rho, beta = kseq_rho(p_row, q_row, n, backend)  # [B], [B]
    # Each candidate's test reads its own uniform, so all K are tested at once and the first
    # one that passes is taken: the same as testing them in turn and stopping there.
    p_c, q_c = p_row.gather(-1, cand).double(), q_row.gather(-1, cand).double()  # [B, K]
    accept = is_cand & (u[:, : cand.shape[1]] * rho[:, None] * q_c < p_c)
    decided = accept.any(-1)
    token = cand.gather(-1, accept.to(torch.int8).argmax(-1, keepdim=True)).squeeze(-1)
    if backend.reads_host and bool(decided.all()):  # no residual row: skip 7 passes
        return token
    # Residual: p - min(q, p/ρ) (1 - (1-β)^n) / β; β = 0 subtracts nothing. One candidate:
    # token verification's p - min(q, p), a scale of 1 exactly (the CUDA kernels leave β at
    # 0 on such rows: they do not read them).
    accept_mass = 1 - (1 - beta) ** n
    scale = torch.where(beta > 0, accept_mass / beta.clamp_min(1e-300), 0.0)
    scale = torch.where(n > 1, scale, 1.0).to(p_row.dtype)
    if backend.compiled_loops:
        rows = (~decided).nonzero().squeeze(-1)  # the undecided rows only, one pass over each
        rho32 = rho.to(p_row.dtype)
        recovered = loops.kseq_residual_tokens(p_row, q_row, rows, rho32, scale, u[:, -1])
        return token.index_copy(0, rows, recovered)
    overlap = torch.minimum(q_row, p_row / rho[:, None].to(p_row.dtype))
    residual = positive_part_or(p_row - overlap * scale[:, None], p_row)
    recovered = sample_from_weights(residual, u[:, -1])
    return torch.where(decided, token, recovered)


def kseq_rho(p_row: torch.Tensor, q_row: torch.Tensor, n: torch.Tensor, backend: Backend):
    """Smallest ρ in [1, n] with 1 - (1 - β(ρ))^n <= ρ β(ρ), β(ρ) = Σ min(q, p/ρ). [B] each.

    f(ρ) = ρ β(ρ) - 1 + (1 - β(ρ))^n is nondecreasing with f(n) >= 0. min(q, p/ρ) = q iff
    ratio p/q >= ρ, so β(ρ) = Q(ratio >= ρ) + P(ratio < ρ)/ρ: after one sort of each row by
    ratio, prefix masses of p and q give f at any ρ (a binary search among the sorted ratios)
    without a pass over V. The root is bracketed by a search that evaluates f at evenly spaced
    ρ of [lo, hi] at once and keeps the part where f turns >= 0, round after round (16 ways
    for 8 rounds on CPU, 256 for 4 elsewhere): a fixed number of batched steps, no host reads.
    Both end on the same grid of 2^32 parts of [1, n], but their probes round differently, so
    ρ*'s last bits can depend on the device (as float sums on a GPU do), never on the batch.
    The result is a ρ where f was found >= 0, so it is lossless whatever its distance to the
    root; only acceptance could be a hair below optimal. n <= 1 gives ρ = 1 (token
    verification). Masses accumulate in float64.
    """
    nf = n.double().clamp_min(1)
    several = nf > 1  # a node with one candidate runs token verification: ρ* = 1
    if backend.reads_host:  # sort and solve only the nodes with several candidates
        rows = several.nonzero().squeeze(-1)
        if rows.numel() == nf.numel():
            return kseq_rho_all(p_row, q_row, nf, backend)
        rho, beta = torch.ones_like(nf), torch.minimum(q_row, p_row).sum(-1, dtype=torch.float64)
        if rows.numel():
            rho_several, beta_several = kseq_rho_all(p_row[rows], q_row[rows], nf[rows], backend)
            rho, beta = rho.index_copy(0, rows, rho_several), beta.index_copy(0, rows, beta_several)
        return rho, beta
    return kseq_rho_all(p_row, q_row, nf, backend)  # rows with n = 1 solve to ρ = 1 at once


def kseq_rho_all(p_row: torch.Tensor, q_row: torch.Tensor, nf: torch.Tensor, backend: Backend):
    """kseq_rho's sort and search for every row (nf [B]: n as float64). -> ρ [B], β(ρ) [B].
    The numba backend: loops.kseq_rho, the same sums and probes in one loop a row."""
    # Tokens off a small draft support have ratio +inf and no q mass: they are never below ρ
    # and add nothing to Q, so they are left out of the sort (the same sums, bit for bit).
    support = draft_support(q_row, backend)
    if support is not None:
        p_row, q_row = p_row.index_select(-1, support), q_row.index_select(-1, support)
    if backend.compiled_loops:  # the sort words, the sort, then one loop a row
        return loops.kseq_rho(p_row, q_row, nf, *SEARCH_NARROW)
    ratio = ratio_key(p_row, q_row)  # [B, V]
    ratio_sorted, order = sort_ascending(ratio)
    ratio_sorted = ratio_sorted.double()  # [B, V]: compared with float64 ρ
    zero = torch.zeros_like(nf).unsqueeze(-1)
    p_below = torch.cat([zero, cumsum64(p_row.gather(-1, order))], dim=-1)  # [B, V+1]
    q_below = torch.cat([zero, cumsum64(q_row.gather(-1, order))], dim=-1)
    # Q relative to its total (off-support tokens add exact zeros to it): where p = q the float
    # sum differs from 1 by ~1e-8, which would push f(1) below 0 and ρ* off 1.
    q_total = q_below[:, -1:].clamp_min(1e-300)  # [B, 1]
    power = nf.unsqueeze(-1)  # [B, 1]

    def f_beta(rho):  # ρ [B, m] -> f(ρ), β(ρ) [B, m]
        # The j first sorted ratios are below ρ; one equal to ρ counts above (min(q, p/ρ) = q:
        # at ρ = 1, β(1) = Q = 1 exactly where p = q).
        j = torch.searchsorted(ratio_sorted, rho)
        beta = (q_total - q_below.gather(-1, j)) / q_total + p_below.gather(-1, j) / rho
        return rho * beta - 1 + (1 - beta).clamp_min(0) ** power, beta

    # Each round keeps f(lo) < 0 <= f(hi), with lo = hi where f(lo) >= 0: the first round
    # probes ρ = 1 itself, and ρ* = 1 where f(1) >= 0.
    lo, hi = torch.ones_like(power), power
    ways, rounds = SEARCH_NARROW if nf.device.type == "cpu" else SEARCH_WIDE
    steps = torch.arange(ways, device=nf.device, dtype=torch.float64) / ways
    at_hi = torch.arange(ways + 1, device=nf.device) == ways
    for _ in range(rounds):
        # lo and the ways - 1 inner points of [lo, hi], then hi itself (f >= 0 there).
        probe = torch.cat([lo + (hi - lo) * steps, hi], dim=-1)  # [B, ways + 1]
        feasible = (f_beta(probe)[0] >= 0) | at_hi
        m = feasible.to(torch.int8).argmax(-1, keepdim=True)  # the first probe with f >= 0
        lo = probe.gather(-1, (m - 1).clamp_min(0))  # the probe before it (probe 0 is lo)
        hi = probe.gather(-1, m)
    return hi.squeeze(-1), f_beta(hi)[1].squeeze(-1)
