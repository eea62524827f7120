"""SpecTr's and SpecInfer's node rules on CUDA (Triton), without a sort: the launchers of the
kernels in spectr_kernels.py and rrs_kernels.py. On CPU SpecTr's ρ* runs as one numba loop a
row (loops.py); the reference rules are in __init__.py."""

from __future__ import annotations

import functools

import torch

from .. import kernels as shared

# SpecTr's node sums every probe of a round at once ([probes, KSEQ_BLOCK] float64 a step),
# each row split over programs: about KSEQ_PROGRAMS_PER_SM a multiprocessor in all. The best
# settings of a sweep on an H100 (its script: `git show e2f0d34:scripts/bench_kseq_knobs.py`;
# rerun it on a new GPU).
KSEQ_BLOCK = 128
KSEQ_DRAW_BLOCK = 1024  # the residual's draw: a running sum, wide steps (draw_residual)
KSEQ_WARPS = 4
KSEQ_PROGRAMS_PER_SM = 2
KSEQ_MAX_SPLITS = 64


@functools.cache
def _kseq_kernels():
    from . import spectr_kernels

    return spectr_kernels.round_kernel, spectr_kernels.tests_kernel, spectr_kernels.draw_kernel


def kseq_token(
    p_row: torch.Tensor,  # [B, V]: target rows at the nodes (contiguous along V)
    q_row: torch.Tensor,  # [B, V]: draft rows
    cand: torch.Tensor,  # [B, K] int64: the node's candidates
    is_cand: torch.Tensor,  # [B, K] bool: the ones that pass through it
    u: torch.Tensor,  # [B, K+1]: the node's uniforms
    search: tuple[int, int],  # (ways, rounds) of the ρ* search, ways a power of two >= 4
    block: int | None = None,  # columns per step, KSEQ_BLOCK (tests take other ones)
    programs: int | None = None,  # programs per call, KSEQ_PROGRAMS_PER_SM a multiprocessor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SpecTr's node rule (top_down.spectr_rule) without a sort: kseq_rho_all's search for ρ*
    on the same grid, with f at each round's probes summed over the row directly (P below and
    Q above each probe), each row split into chunks over several programs; then β(ρ*), the K
    tests, and where all are rejected the residual draw by inverse CDF. -> (token [B] int64,
    ρ [B], β(ρ) [B] float64). rounds + 2 kernels, no host reads. A row with one candidate
    (below where the paths part, or a finished request's) is token verification: ρ* = 1,
    and the rounds skip it (β is left at 0 there; its residual does not read β)."""
    triton, _ = shared._triton()
    B, V = p_row.shape
    K = cand.shape[1]
    block = block or KSEQ_BLOCK
    ways, rounds = search
    if programs is None:
        programs = KSEQ_PROGRAMS_PER_SM * shared._multiprocessors(p_row.device)
    tiles = triton.cdiv(V, block)
    splits = max(1, min(tiles, KSEQ_MAX_SPLITS, triton.cdiv(programs, B)))
    chunk = triton.cdiv(tiles, splits) * block
    splits = triton.cdiv(V, chunk)  # no empty chunk
    dev = p_row.device
    state = torch.empty(2, B, (3 * splits + 2) * ways, dtype=torch.float64, device=dev)
    mass = torch.empty(B, splits, 2, dtype=torch.float64, device=dev)
    token = torch.empty(B, dtype=torch.int64, device=dev)
    rho = torch.empty(B, dtype=torch.float64, device=dev)
    beta = torch.empty_like(rho)
    is_cand = is_cand.to(torch.int8)
    round_kernel, tests_kernel, draw_kernel = _kseq_kernels()
    shape = dict(K=K, KP=triton.next_power_of_2(K), SP=triton.next_power_of_2(splits))
    grid = (B, splits)
    warps = dict(num_warps=KSEQ_WARPS)
    for r in range(rounds):
        round_kernel[grid](
            p_row, q_row, is_cand, state[(r + 1) % 2], state[r % 2], V,
            p_row.stride(0), q_row.stride(0), is_cand.stride(0), is_cand.stride(1),
            splits, chunk, WAYS=ways, FIRST=r == 0,
            BF16=p_row.dtype == q_row.dtype == torch.bfloat16,
            BLOCK=block, **shape, **warps,
        )  # fmt: skip
    f64 = torch.float64 in (p_row.dtype, q_row.dtype)
    tests_kernel[grid](
        p_row, q_row, cand, is_cand, u, state[(rounds - 1) % 2], mass, token, rho, beta, V,
        p_row.stride(0), q_row.stride(0), cand.stride(0), cand.stride(1),
        is_cand.stride(0), is_cand.stride(1), u.stride(0), u.stride(1),
        splits, chunk, WAYS=ways, F64=f64, BLOCK=block, **shape, **warps,
    )  # fmt: skip
    draw_kernel[grid](
        p_row, q_row, is_cand, u, mass, token, rho, beta, V,
        p_row.stride(0), q_row.stride(0), is_cand.stride(0), is_cand.stride(1),
        u.stride(0), u.stride(1), splits, chunk, F64=f64, BLOCK=KSEQ_DRAW_BLOCK, **shape,
        **warps,
    )  # fmt: skip
    return token, rho, beta


@functools.cache
def _rrs_kernels():
    from . import rrs_kernels

    return rrs_kernels.level_kernel, rrs_kernels.tests_kernel, rrs_kernels.draw_kernel


def rrs_token(
    p_row: torch.Tensor,  # [B, V]: target rows at the nodes (contiguous along V)
    q_row: torch.Tensor,  # [B, V]: draft rows
    cand: torch.Tensor,  # [B, K] int64: the node's candidates, in path order
    is_cand: torch.Tensor,  # [B, K] bool: the ones that pass through it
    u: torch.Tensor,  # [B, K+1]: the node's uniforms
) -> torch.Tensor:
    """SpecInfer's node rule (top_down.specinfer_rule): the K levels' masses
    F(t_j) = Σ (p - t_j q)_+, each row split into chunks as :func:`row_masses` splits it (the
    same sums); the tests; and where all are rejected level n_v's residual drawn by inverse
    CDF. -> token [B] int64. K + 2 kernels, no host reads (rrs_kernels.py); a level above a
    node's n candidates does not read its row."""
    triton, _ = shared._triton()
    B, V = p_row.shape
    K = cand.shape[1]
    chunk, splits = shared.row_chunks(V)  # the chunks of row_masses: the same level sums
    dev = p_row.device
    levels = torch.empty(B, K + 1, splits, dtype=torch.float64, device=dev)
    mass = torch.empty(B, splits, 2, dtype=torch.float64, device=dev)
    token = torch.empty(B, dtype=torch.int64, device=dev)
    t_draw = torch.empty(B, dtype=torch.float64, device=dev)
    is_cand = is_cand.to(torch.int8)
    level_kernel, tests_kernel, draw_kernel = _rrs_kernels()
    grid = (B, splits)
    common = dict(
        SP=triton.next_power_of_2(splits),
        F64=torch.float64 in (p_row.dtype, q_row.dtype),
        BLOCK=shared.BLOCK,
        num_warps=8,
    )
    work = torch.float64 if common["F64"] else torch.float32  # specinfer_rule's dtype
    max_scalar = torch.finfo(work).max / 4
    for level in range(1, K + 1):
        level_kernel[grid](
            p_row, q_row, is_cand, levels, level, V, p_row.stride(0), q_row.stride(0),
            is_cand.stride(0), is_cand.stride(1), splits, chunk, max_scalar, K=K,
            KP=triton.next_power_of_2(K), **common,
        )  # fmt: skip
    tests_kernel[grid](
        p_row, q_row, cand, is_cand, u, levels, mass, token, t_draw, V,
        p_row.stride(0), q_row.stride(0), cand.stride(0), cand.stride(1),
        is_cand.stride(0), is_cand.stride(1), u.stride(0), u.stride(1), splits, chunk,
        max_scalar, K=K, KP=triton.next_power_of_2(K), LP=triton.next_power_of_2(K + 1),
        **common,
    )  # fmt: skip
    draw_kernel[grid](
        p_row, q_row, u, mass, token, t_draw, V, p_row.stride(0), q_row.stride(0),
        u.stride(0), u.stride(1), splits, chunk, max_scalar, K=K, **common,
    )  # fmt: skip
    return token
