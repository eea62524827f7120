"""SpecTr's node rule on CUDA without a sort (kernels.kseq_token launches these): the ρ*
search of top_down.kseq_rho_all, round by round, each round one kernel whose programs sum P
below and Q above every probe over a chunk of the row; then the tests and the residual's
chunk masses; then its inverse-CDF draw. The helpers are module-level because Triton (and its
interpreter) resolves a kernel's callees among the module's globals.

A round's state, per row: for each chunk CH = 3 WAYS float64 (P of the in-range keys below
each probe, their Q at or above it, then P and Q of the keys below lo, Q at or above hi, P in
range: WAYS >= 4), then the probes, then hi. Keys in [lo, hi) are "in range"; probe 0 is lo.

Imported only where Triton is installed (kernels._kseq_kernels).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def node_count(is_cand_ptr, b, i_s0, i_s1, K: tl.constexpr, KP: tl.constexpr):
    """n: the candidates that pass through the node (at least 1)."""
    ks = tl.arange(0, KP)
    is_cand = tl.load(is_cand_ptr + b * i_s0 + ks * i_s1, mask=ks < K, other=0) != 0
    return tl.maximum(tl.sum(is_cand.to(tl.int32), axis=0), 1)


@triton.jit
def pick(x, lanes, i):
    """x[i] of a small vector (i a scalar)."""
    return tl.sum(tl.where(lanes == i, x, 0.0), axis=0)


@triton.jit
def candidates(
    p_row, q_row, cand_ptr, is_cand_ptr, u_ptr, b, c_s0, c_s1, i_s0, i_s1, u_s0, u_s1,
    K: tl.constexpr, KP: tl.constexpr,
):  # fmt: skip
    """The node's K candidates on KP lanes: (lanes, ids in path order, whether each passes
    through the node, p and q at each in float64, each test's uniform)."""
    ks = tl.arange(0, KP)
    in_k = ks < K
    cand = tl.load(cand_ptr + b * c_s0 + ks * c_s1, mask=in_k, other=0)
    is_cand = tl.load(is_cand_ptr + b * i_s0 + ks * i_s1, mask=in_k, other=0) != 0
    p_c = tl.load(p_row + cand, mask=in_k, other=0.0).to(tl.float64)
    q_c = tl.load(q_row + cand, mask=in_k, other=0.0).to(tl.float64)
    u_c = tl.load(u_ptr + b * u_s0 + ks * u_s1, mask=in_k, other=1.0).to(tl.float64)
    return ks, cand, is_cand, p_c, q_c, u_c


@triton.jit
def first_passing(passes, ks, cand, KP: tl.constexpr):
    """The first candidate whose test passes: (its lane, KP where none does; its id, -1
    where none does)."""
    first = tl.min(tl.where(passes, ks, KP), axis=0)
    token = tl.sum(tl.where(ks == first, cand, 0), axis=0)
    return first, tl.where(first < KP, token, -1)


@triton.jit
def choose(state_row, n, S, K: tl.constexpr, WAYS: tl.constexpr, SP: tl.constexpr):
    """One round's outcome from its chunks' sums: (lo, hi) of the next round and β(hi).
    Every program of a row sums the same chunks in the same order: the same bits."""
    CH: tl.constexpr = 3 * WAYS
    lanes = tl.arange(0, WAYS)
    chunks = tl.arange(0, SP)[:, None]
    offs = chunks * CH + lanes[None, :]
    p_in = tl.sum(tl.load(state_row + offs, mask=chunks < S, other=0.0), axis=0)
    q_in = tl.sum(tl.load(state_row + WAYS + offs, mask=chunks < S, other=0.0), axis=0)
    extra = tl.sum(tl.load(state_row + 2 * WAYS + offs, mask=chunks < S, other=0.0), axis=0)
    p_lo, q_lo = pick(extra, lanes, 0), pick(extra, lanes, 1)
    q_hi, p_in_all = pick(extra, lanes, 2), pick(extra, lanes, 3)
    probe = tl.load(state_row + S * CH + lanes)
    hi = tl.load(state_row + S * CH + WAYS)
    p_below = p_lo + p_in
    q_above = q_hi + q_in
    # every in-range key is at or above probe 0 (lo), so q_above[0] + Q below lo is the
    # total; where p = q (every key 1, lo = 1) it is q_above[0] itself: β(1) = 1 exactly
    q_total = tl.maximum(pick(q_above, lanes, 0) + q_lo, 1e-300)
    beta = q_above / q_total + p_below / probe
    miss = tl.full([WAYS], 1.0, tl.float64)
    for i in tl.static_range(K):
        miss = tl.where(i < n, miss * tl.maximum(1 - beta, 0.0), miss)
    m = tl.min(tl.where(probe * beta - 1 + miss >= 0, lanes, WAYS), axis=0)
    # m = WAYS: no probe below hi is feasible, and hi is (kseq_rho_all's at_hi)
    beta_hi = q_hi / q_total + (p_lo + p_in_all) / hi
    lo_next = pick(probe, lanes, tl.maximum(m - 1, 0))
    hi_next = tl.where(m < WAYS, pick(probe, lanes, m), hi)
    return lo_next, hi_next, tl.where(m < WAYS, pick(beta, lanes, m), beta_hi)


@triton.jit
def round_kernel(
    p_ptr,  # [B, V]: target rows by id (row stride p_s0)
    q_ptr,  # [B, V]: draft rows by id (row stride q_s0)
    is_cand_ptr,  # [B, K] int8: the candidates that pass through the node
    prev_ptr,  # [B, S CH + 2 WAYS] float64: the previous round's state (unused in the first)
    state_ptr,  # [B, S CH + 2 WAYS] float64 out: this round's
    V,
    p_s0,
    q_s0,
    i_s0,
    i_s1,
    S,  # programs (chunks) per row
    CHUNK,  # columns per chunk, a multiple of BLOCK
    K: tl.constexpr,
    KP: tl.constexpr,
    WAYS: tl.constexpr,
    SP: tl.constexpr,
    FIRST: tl.constexpr,
    BF16: tl.constexpr,  # bfloat16 rows: the key rounds to bfloat16 (ratio_key)
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    CH: tl.constexpr = 3 * WAYS
    n = node_count(is_cand_ptr, b, i_s0, i_s1, K, KP)
    row_size = S * CH + 2 * WAYS
    if FIRST:
        lo = tl.full([], 1.0, tl.float64)
        hi = n.to(tl.float64)
    else:
        lo, hi, _ = choose(prev_ptr + b * row_size, n, S, K, WAYS, SP)
    # lo and the WAYS - 1 inner points of [lo, hi] (kseq_rho_all's probes but hi)
    lanes = tl.arange(0, WAYS)
    probe = lo + (hi - lo) * (lanes.to(tl.float64) / WAYS)
    p_row = p_ptr + b * p_s0
    q_row = q_ptr + b * q_s0
    # per lane and column, summed across columns once after the loop: a cross-thread sum of
    # every probe at every step would cost more than the step
    p_in = tl.zeros([WAYS, BLOCK], tl.float64)
    q_in = tl.zeros([WAYS, BLOCK], tl.float64)
    p_lo = tl.zeros([BLOCK], tl.float64)
    q_lo = tl.zeros([BLOCK], tl.float64)
    q_hi = tl.zeros([BLOCK], tl.float64)
    p_in_all = tl.zeros([BLOCK], tl.float64)
    cols0 = tl.arange(0, BLOCK)
    start = s * CHUNK
    # A node with one candidate (a path's own node below where the paths part, or a finished
    # request's) has ρ* = 1 and never reads β (residual_scale): its row is not read at all.
    # With every sum 0, choose keeps lo = hi = 1 round after round.
    span = CHUNK * (n > 1).to(tl.int32)
    for off in range(0, span, BLOCK):
        cols = start + off + cols0
        inside = cols < V
        p = tl.load(p_row + cols, mask=inside, other=0.0)
        q = tl.load(q_row + cols, mask=inside, other=0.0)
        # sorting.ratio_key: p/q in the rows' dtype (IEEE division), +inf where q = 0
        if BF16:  # float32 p/q to the nearest even bfloat16, by its bits (a cast: the
            # interpreter truncates)
            bits = tl.math.div_rn(p.to(tl.float32), q.to(tl.float32)).to(tl.uint32, bitcast=True)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            key = bits.to(tl.float32, bitcast=True)
        elif p.dtype == tl.float32:
            key = tl.math.div_rn(p, q)
        else:
            key = p / q
        key = tl.where(q > 0, key.to(tl.float64), float("inf"))
        p64, q64 = p.to(tl.float64), q.to(tl.float64)
        below_lo = key < lo
        above_hi = key >= hi
        in_range = (key >= lo) & (key < hi)
        p_lo += tl.where(below_lo, p64, 0.0)
        q_lo += tl.where(below_lo, q64, 0.0)
        q_hi += tl.where(above_hi, q64, 0.0)
        p_in_all += tl.where(in_range, p64, 0.0)
        below = key[None, :] < probe[:, None]  # [WAYS, BLOCK]
        p_in += tl.where(below & in_range[None, :], p64[None, :], 0.0)
        q_in += tl.where(~below & in_range[None, :], q64[None, :], 0.0)
    out = state_ptr + b * row_size + s * CH
    tl.store(out + lanes, tl.sum(p_in, axis=1))
    tl.store(out + WAYS + lanes, tl.sum(q_in, axis=1))
    extra = tl.where(lanes == 0, tl.sum(p_lo, axis=0), 0.0)
    extra = tl.where(lanes == 1, tl.sum(q_lo, axis=0), extra)
    extra = tl.where(lanes == 2, tl.sum(q_hi, axis=0), extra)
    extra = tl.where(lanes == 3, tl.sum(p_in_all, axis=0), extra)
    tl.store(out + 2 * WAYS + lanes, extra)
    if s == 0:
        tl.store(state_ptr + b * row_size + S * CH + lanes, probe)
        tl.store(state_ptr + b * row_size + S * CH + WAYS, hi)


@triton.jit
def residual_scale(rho, beta, n, K: tl.constexpr, compute: tl.constexpr):
    """(ρ, (1 - (1-β)^n) / β) in the residual's dtype; β = 0 subtracts nothing; n = 1: 1
    exactly, whatever β (token verification's residual; round_kernel leaves β at 0 there)."""
    none_pass = rho * 0.0 + 1.0  # (1 - β)^n
    for i in tl.static_range(K):
        none_pass = tl.where(i < n, none_pass * (1 - beta), none_pass)
    scale = (1 - none_pass) / tl.maximum(beta, 1e-300)
    scale = tl.where(n > 1, tl.where(beta > 0, scale, 0.0), 1.0)
    return rho.to(compute), scale.to(compute)


@triton.jit
def residual_weight(p, q, x, y, SPECTR: tl.constexpr):
    """A node's residual weight in the rows' compute dtype, clamped at 0: SpecTr's
    p - min(q, p/ρ) scale (x = ρ, y = scale), or SpecInfer's p - t q (x = t). The chunk masses
    and the draw both compute it here, so the draw walks the weights the masses summed."""
    if SPECTR:  # noqa: SIM108 (a constexpr branch: one body compiled)
        w = p - tl.minimum(q, p / x) * y
    else:
        w = p - x * q
    return tl.maximum(w, 0.0)


@triton.jit
def chunk_masses(
    p_row, q_row, x, y, V, CHUNK, SPECTR: tl.constexpr, compute: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """This program's chunk (program_id(1)) masses of the residual (residual_weight) and of
    p, float64. A caller that needs only the first leaves the second to the compiler."""
    residual_sum = tl.zeros([BLOCK], tl.float64)
    p_sum = tl.zeros([BLOCK], tl.float64)
    start = tl.program_id(1) * CHUNK
    for off in range(0, CHUNK, BLOCK):
        cols = start + off + tl.arange(0, BLOCK)
        inside = cols < V
        p = tl.load(p_row + cols, mask=inside, other=0.0).to(compute)
        q = tl.load(q_row + cols, mask=inside, other=0.0).to(compute)
        p_sum += p.to(tl.float64)
        residual_sum += residual_weight(p, q, x, y, SPECTR).to(tl.float64)
    return tl.sum(residual_sum, axis=0), tl.sum(p_sum, axis=0)


@triton.jit
def store_chunk_masses(
    p_row, q_row, mass_out, x, y, V, CHUNK, SPECTR: tl.constexpr, compute: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """chunk_masses into mass_out[0], mass_out[1]: the draw's chunk masses of the residual,
    and of p (drawn from where nothing is left)."""
    residual, p = chunk_masses(p_row, q_row, x, y, V, CHUNK, SPECTR, compute, BLOCK)
    tl.store(mass_out, residual)
    tl.store(mass_out + 1, p)


@triton.jit
def tests_kernel(
    p_ptr,
    q_ptr,
    cand_ptr,  # [B, K] int64: the candidates
    is_cand_ptr,
    u_ptr,  # [B, K+1]: a uniform per candidate test, then one for the residual draw
    state_ptr,  # [B, S CH + 2 WAYS] float64: the last round's state
    mass_ptr,  # [B, S, 2] float64 out: per chunk, the residual's mass and p's
    token_ptr,  # [B] int64 out: the accepted candidate, -1 where all are rejected
    rho_ptr,  # [B] float64 out
    beta_ptr,  # [B] float64 out
    V,
    p_s0,
    q_s0,
    c_s0,
    c_s1,
    i_s0,
    i_s1,
    u_s0,
    u_s1,
    S,
    CHUNK,
    K: tl.constexpr,
    KP: tl.constexpr,
    WAYS: tl.constexpr,
    SP: tl.constexpr,
    F64: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    n = node_count(is_cand_ptr, b, i_s0, i_s1, K, KP)
    _, rho, beta = choose(state_ptr + b * (S * 3 * WAYS + 2 * WAYS), n, S, K, WAYS, SP)
    p_row = p_ptr + b * p_s0
    q_row = q_ptr + b * q_s0
    # the candidates' tests, each with its own uniform: the first that passes is taken
    ks, cand, is_cand, p_c, q_c, u_c = candidates(
        p_row, q_row, cand_ptr, is_cand_ptr, u_ptr, b, c_s0, c_s1, i_s0, i_s1, u_s0, u_s1, K, KP
    )
    first, token = first_passing(is_cand & (u_c * rho * q_c < p_c), ks, cand, KP)
    if s == 0:
        tl.store(token_ptr + b, token)
        tl.store(rho_ptr + b, rho)
        tl.store(beta_ptr + b, beta)
    if first == KP:
        # every candidate rejected: this chunk's mass of the residual
        # p - min(q, p/ρ) (1 - (1-β)^n) / β clamped at 0, and of p (where nothing is left)
        compute = tl.float64 if F64 else tl.float32
        rho_c, scale = residual_scale(rho, beta, n, K, compute)
        mass_out = mass_ptr + (b * S + s) * 2
        store_chunk_masses(p_row, q_row, mass_out, rho_c, scale, V, CHUNK, True, compute, BLOCK)


@triton.jit
def draw_kernel(
    p_ptr,
    q_ptr,
    is_cand_ptr,
    u_ptr,
    mass_ptr,  # [B, S, 2] float64: tests_kernel's chunk masses
    token_ptr,  # [B] int64 in/out: -1 becomes the residual's draw
    rho_ptr,
    beta_ptr,
    V,
    p_s0,
    q_s0,
    i_s0,
    i_s1,
    u_s0,
    u_s1,
    S,
    CHUNK,
    K: tl.constexpr,
    KP: tl.constexpr,
    SP: tl.constexpr,
    F64: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The residual's draw where every candidate was rejected (draw_residual)."""
    b = tl.program_id(0).to(tl.int64)
    if tl.load(token_ptr + b) < 0:
        n = node_count(is_cand_ptr, b, i_s0, i_s1, K, KP)
        compute = tl.float64 if F64 else tl.float32
        rho_c, scale = residual_scale(tl.load(rho_ptr + b), tl.load(beta_ptr + b), n, K, compute)
        u_draw = tl.load(u_ptr + b * u_s0 + K * u_s1).to(tl.float64)
        draw_residual(
            p_ptr + b * p_s0, q_ptr + b * q_s0, mass_ptr + b * S * 2, token_ptr + b, u_draw,
            rho_c, scale, V, S, CHUNK, True, SP, compute, BLOCK,
        )  # fmt: skip


@triton.jit
def draw_residual(
    p_row,
    q_row,
    mass_row,  # [S, 2] float64: per chunk, the residual's mass and p's
    token_out,  # the row's token
    u_draw,  # float64
    x,  # SPECTR: ρ; else t (the residual (p - t q)_+)
    y,  # SPECTR: the residual's scale (residual_weight); else unused
    V,
    S,
    CHUNK,
    SPECTR: tl.constexpr,
    SP: tl.constexpr,
    compute: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """A residual's draw by inverse CDF in id order: the chunk whose running mass first
    passes u times the total (p itself where nothing is left), then, in that chunk's program,
    the first token in it whose running mass does, its weights computed as the chunk masses'
    (residual_weight). The running sum is a chain of BLOCK-column steps, so the launcher
    picks wide ones (narrow chunks make the draw a long chain of dependent
    steps)."""
    s = tl.program_id(1)
    chunks = tl.arange(0, SP)
    residual_run = tl.cumsum(tl.load(mass_row + chunks * 2, mask=chunks < S, other=0.0), 0)
    p_run = tl.cumsum(tl.load(mass_row + chunks * 2 + 1, mask=chunks < S, other=0.0), 0)
    use_p = tl.max(residual_run, axis=0) <= 0  # nothing left: draw from p itself
    run = tl.where(use_p, p_run, residual_run)  # [SP], nondecreasing
    total = tl.max(run, axis=0)
    target = tl.minimum(u_draw * total, total * (1 - 2.0**-53))  # < total
    here = tl.minimum(tl.min(tl.where(run > target, chunks, SP), axis=0), S - 1)
    if s == here:
        carry = tl.sum(tl.where(chunks == s - 1, run, 0.0), axis=0)
        lanes = tl.arange(0, BLOCK)
        found = tl.full([BLOCK], V, tl.int32)  # per lane: the first hit's id, V: none
        last = tl.full([BLOCK], -1, tl.int32)  # per lane: the last positive weight's id
        start = s * CHUNK
        for off in range(0, CHUNK, BLOCK):  # BLOCK need not divide CHUNK
            cols = start + off + lanes
            inside = (cols < V) & (off + lanes < CHUNK)
            p = tl.load(p_row + cols, mask=inside, other=0.0).to(compute)
            q = tl.load(q_row + cols, mask=inside, other=0.0).to(compute)
            w = tl.where(use_p, p, residual_weight(p, q, x, y, SPECTR)).to(tl.float64)
            cdf = carry + tl.cumsum(w, 0)
            carry = tl.max(tl.where(lanes == BLOCK - 1, cdf, -1.0), axis=0)
            positive = inside & (w > 0)
            found = tl.minimum(found, tl.where(positive & (cdf > target), cols, V))
            last = tl.maximum(last, tl.where(positive, cols, -1))
        # rounding could leave no running mass above the target: the chunk's last weight
        found_id = tl.min(found, axis=0)
        token = tl.where(found_id < V, found_id, tl.max(last, axis=0))
        tl.store(token_out, token.to(tl.int64))
