"""Known facts about the verifiers (spec §1-§12) and the contract of ``verify``.

- the toy example's E[τ] (10/9 token, 11/9 block, 12/9 greedy block; spec §12), by Monte Carlo;
- the K = 1 reductions (spec §6-§10): SpecInfer and SpecTr are token verification, GBV and
  traversal are block verification, SpecTr-GBV* is greedy block verification;
- seeded determinism and batch independence (per-request generators), carry included;
- temperature 0: every method is greedy prefix matching when target and draft are one-hot;
- input validation (ValueError naming the problem) and the residual-mass-zero edge cases.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch
from harness import (
    ALPHA,
    SPEC_NAMES,
    WindowModel,
    check_output,
    chi_square,
    decode_loop,
    draft_block,
    load_reference,
    loop_law_pvalue,
    method_step,
    one_iteration,
    random_rows,
    reference_models,
    sample_paths,
)

from blockspec.verification import (
    METHODS,
    ROW_SUM_TOL,
    VERIFIERS,
    Backend,
    TargetModification,
    verify,
)

INSTANCES, NUMBERS = load_reference()
CARRY_METHODS = [m for m in METHODS if VERIFIERS[m].modifies_target]


def k_of(method: str, multi: int = 3) -> int:
    return 1 if VERIFIERS[method].single_path else multi


# ---------------------------------------------------------------------------------------------
# Toy example: E[τ] = 10/9 (token), 11/9 (block), 12/9 (greedy block), one iteration.
# ---------------------------------------------------------------------------------------------

TOY_N = 300_000
TOY_Z = 4.5


def test_toy_expected_accepted_tokens():
    """z-test of the mean τ at 4.5 σ for each method, plus a check that N separates the three.

    sd(τ) <= 0.9 here, so the standard error at N = 300k is <= 1.7e-3: the exact means are 1/9
    apart, i.e. > 30 standard errors, and a method that behaved like its neighbour (e.g. block
    verification with a break, or greedy without the joint acceptance rule) fails its z-test.
    """
    target, draft, gamma = reference_models("toy")
    exact = {"token": 10 / 9, "block": 11 / 9, "greedy_block": 12 / 9}
    means, ses = {}, {}
    for i, (method, expected) in enumerate(exact.items()):
        spec_name = {"token": "TV", "block": "BV", "greedy_block": "GreedyBV"}[method]
        ref = NUMBERS["numbers"]["toy"]["K=1"][spec_name]
        assert math.isclose(ref["E_tau"], expected, rel_tol=1e-9)
        var = sum(t * t * pr for t, pr in enumerate(ref["tau_law"])) - expected**2
        gen = torch.Generator().manual_seed(100 + i)
        x = sample_paths(draft, TOY_N, 1, gamma, gen)
        q = draft.rows(x, range(gamma)).float()
        p = target.rows(x, range(gamma + 1)).float()
        out = verify(method, x, q, p, generator=gen)
        means[method] = float(out.num_accepted.double().mean())
        ses[method] = math.sqrt(var / TOY_N)
        z = (means[method] - expected) / ses[method]
        assert abs(z) < TOY_Z, f"{method}: E[τ] {means[method]:.5f} vs {expected:.5f} (z = {z:.1f})"
    order = list(exact)
    for a, b in itertools.pairwise(order):
        assert exact[b] - exact[a] > 2 * TOY_Z * max(ses[a], ses[b])  # N separates them
        assert means[b] - means[a] > TOY_Z * math.hypot(ses[a], ses[b]), (a, b, means)


# ---------------------------------------------------------------------------------------------
# K = 1 reductions (spec §6, §7, §8, §9, §10) against the reduced method's exact law.
# ---------------------------------------------------------------------------------------------

REDUCTIONS = {
    "specinfer": "TV",
    "spectr": "TV",
    "gbv": "BV",
    "traversal": "BV",
    "spectr_gbv": "GreedyBV",
}
REDUCTION_N = 100_000


@pytest.mark.parametrize("instance", list(INSTANCES))
@pytest.mark.parametrize("method", list(REDUCTIONS))
def test_k1_reduces_to_single_path_law(method, instance):
    target, draft, gamma = reference_models(instance)
    seed = 200 + 10 * list(REDUCTIONS).index(method) + list(INSTANCES).index(instance)
    outcomes = one_iteration(method, target, draft, REDUCTION_N, 1, gamma, seed=seed)
    law = NUMBERS["numbers"][instance]["K=1"][REDUCTIONS[method]]["output_law"]
    _, _, pvalue = chi_square(Counter(outcomes), law, REDUCTION_N)
    assert pvalue > ALPHA, (
        f"{method} at K=1 is not {REDUCTIONS[method]} on {instance}: {pvalue:.3g}"
    )


def test_power_k1_reduction_tells_token_from_block():
    """The reduction test can fail: GBV at K = 1 (= block verification) is not the token law."""
    target, draft, gamma = reference_models("toy")
    outcomes = one_iteration("gbv", target, draft, REDUCTION_N, 1, gamma, seed=299)
    law = NUMBERS["numbers"]["toy"]["K=1"]["TV"]["output_law"]
    assert chi_square(Counter(outcomes), law, REDUCTION_N)[2] < 1e-9


# ---------------------------------------------------------------------------------------------
# Small context-dependent instances for the contract tests.
# ---------------------------------------------------------------------------------------------

SMALL_V, SMALL_GAMMA = 5, 3
SMALL_TARGET = WindowModel.from_fn(SMALL_V, 2, random_rows(SMALL_V, 61, scale=1.5))
SMALL_DRAFT = WindowModel.from_fn(SMALL_V, 2, random_rows(SMALL_V, 62, scale=1.5))


def small_contexts(batch: int, steps: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random 2-token contexts (different rows per request) with room for `steps` iterations."""
    gen = torch.Generator().manual_seed(seed)
    seq = torch.zeros(batch, 2 + steps * (SMALL_GAMMA + 1) + SMALL_GAMMA, dtype=torch.int64)
    seq[:, :2] = torch.randint(0, SMALL_V, (batch, 2), generator=gen)
    return seq, torch.full((batch,), 2, dtype=torch.int64)


def append(seq: torch.Tensor, count: torch.Tensor, out) -> tuple[torch.Tensor, torch.Tensor]:
    seq = seq.clone()
    for j in range(seq.shape[0]):
        n = int(out.num_tokens[j])
        seq[j, int(count[j]) : int(count[j]) + n] = out.tokens[j, :n]
    return seq, count + out.num_tokens


def outputs_equal(a, b) -> bool:
    return (
        torch.equal(a.tokens, b.tokens)
        and torch.equal(a.num_tokens, b.num_tokens)
        and torch.equal(a.num_accepted, b.num_accepted)
        and torch.equal(a.path, b.path)
    )


# ---------------------------------------------------------------------------------------------
# Seeded determinism.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("per_request", [False, True], ids=["one-generator", "per-request"])
@pytest.mark.parametrize("method", METHODS)
def test_seeded_determinism(method, per_request):
    """Same seed -> identical outputs and carries over 2 steps; another seed -> other outputs
    (so the generator is really used: with 64 requests a fixed output would be noticed)."""
    batch, k = 64, k_of(method)
    seq, count = small_contexts(batch, 2, seed=7)

    def gens(seed):
        if per_request:
            return [torch.Generator().manual_seed(seed * 1000 + j) for j in range(batch)]
        return torch.Generator().manual_seed(seed)

    def two_steps(seed):
        g, dgen = gens(seed), torch.Generator().manual_seed(8)
        x, q, p = draft_block(SMALL_TARGET, SMALL_DRAFT, seq, count, k, SMALL_GAMMA, dgen)
        first = verify(method, x, q, p, generator=g)
        check_output(first, x, SMALL_V)
        seq2, count2 = append(seq, count, first)
        x, q, p = draft_block(SMALL_TARGET, SMALL_DRAFT, seq2, count2, k, SMALL_GAMMA, dgen)
        second = verify(method, x, q, p, generator=g, carry=first.carry)
        check_output(second, x, SMALL_V)
        return first, second

    a1, a2 = two_steps(1)
    b1, b2 = two_steps(1)
    c1, _ = two_steps(2)
    assert outputs_equal(a1, b1) and outputs_equal(a2, b2)
    if VERIFIERS[method].modifies_target:
        for fa, fb in zip((a1.carry, a2.carry), (b1.carry, b2.carry), strict=True):
            assert torch.equal(fa.log_p, fb.log_p) and torch.equal(fa.log_q, fb.log_q)
            assert torch.equal(fa.rows_left, fb.rows_left)
    else:
        assert a1.carry is None
    assert not outputs_equal(a1, c1), "a different seed gave identical outputs"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["cpu-loops", "torch-ops"])
@pytest.mark.parametrize("method", METHODS)
def test_verify_leaves_its_inputs_unchanged(method, dtype):
    """The engine verifies a batch of one kind on views of its rows (workers.step.group_rows), so no
    verifier may write to its tokens, rows or carry: 3 steps, the carry threaded, float32 rows
    (the CPU loops) and float64 (the torch ops)."""
    batch, k = 16, k_of(method)
    seq, count = small_contexts(batch, 3, seed=5)
    dgen = torch.Generator().manual_seed(6)
    x, q, p = draft_block(SMALL_TARGET, SMALL_DRAFT, seq, count, k, SMALL_GAMMA, dgen)
    inputs = (x, q.to(dtype), p.to(dtype))
    before = [t.clone() for t in inputs]
    carry = None
    for step in range(3):
        carried = None if carry is None else (carry.log_p, carry.log_q, carry.rows_left)
        kept = None if carried is None else [t.clone() for t in carried]
        carry = verify(method, *inputs, torch.Generator().manual_seed(step), carry=carry).carry
        assert all(torch.equal(a, b) for a, b in zip(before, inputs, strict=True)), step
        if kept is not None:
            assert all(torch.equal(a, b) for a, b in zip(kept, carried, strict=True)), step


# ---------------------------------------------------------------------------------------------
# Batch independence with per-request generators.
# ---------------------------------------------------------------------------------------------

BATCH_SEEDS = [11, 12, 13, 14, 15, 16]
STEPS = 3


def request_gens(requests: list[int]):
    """(draft generators, verify generators), seeded by the request only."""
    dgens = [torch.Generator().manual_seed(10_000 + BATCH_SEEDS[r]) for r in requests]
    vgens = [torch.Generator().manual_seed(BATCH_SEEDS[r]) for r in requests]
    return dgens, vgens


def run_requests(method: str, gens, seq, count, steps=STEPS, carry=None):
    """Run `steps` iterations on a batch of requests, each drafting and verifying with its own
    generators (``gens`` = (draft generators, verify generators), one each per request).
    Returns (outputs per step, seq, count, carry)."""
    dgens, vgens = gens
    outs = []
    for _ in range(steps):
        x, q, p = draft_block(
            SMALL_TARGET, SMALL_DRAFT, seq, count, k_of(method), SMALL_GAMMA, dgens
        )
        out = verify(method, x, q, p, generator=vgens, carry=carry)
        check_output(out, x, SMALL_V)
        outs.append(out)
        seq, count = append(seq, count, out)
        carry = out.carry
    return outs, seq, count, carry


def row(out, j):
    return (out.tokens[j], out.num_tokens[j], out.path[j])


def same_row(a, b) -> bool:
    return all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


@pytest.mark.parametrize("method", METHODS)
def test_batch_independence(method):
    """Request j's outputs over 3 steps (carry threaded) are identical alone and in a batch with
    other requests (other seeds, other contexts, other τ's, hence other carries)."""
    n = len(BATCH_SEEDS)
    seq, count = small_contexts(n, STEPS, seed=21)
    batch_outs, *_ = run_requests(method, request_gens(list(range(n))), seq, count)
    for j in range(n):
        alone, *_ = run_requests(method, request_gens([j]), seq[j : j + 1], count[j : j + 1])
        for step in range(STEPS):
            assert same_row(row(alone[step], 0), row(batch_outs[step], j)), (j, step)
    taus = torch.stack([o.num_accepted for o in batch_outs])
    assert len(set(taus.flatten().tolist())) > 1  # the requests really differ


@pytest.mark.parametrize("method", CARRY_METHODS)
def test_batch_composition_changes_keep_the_carry(method):
    """Requests join a batch (TargetModification.cat of their carries) and leave it (select):
    every request's outputs equal those of the run where it is alone all along."""
    n = len(BATCH_SEEDS)
    seq, count = small_contexts(n, STEPS, seed=22)
    alone = [
        run_requests(method, request_gens([j]), seq[j : j + 1], count[j : j + 1])[0]
        for j in range(n)
    ]
    # Step 1: every request alone (B = 1); its generators then continue in the batch.
    gens = [request_gens([j]) for j in range(n)]
    firsts = [
        run_requests(method, gens[j], seq[j : j + 1], count[j : j + 1], steps=1) for j in range(n)
    ]
    # Step 2: all requests in one batch, carries concatenated.
    batch_gens = ([g[0][0] for g in gens], [g[1][0] for g in gens])
    out2, seq3, count3, carry3 = run_requests(
        method,
        batch_gens,
        torch.cat([f[1] for f in firsts]),
        torch.cat([f[2] for f in firsts]),
        steps=1,
        carry=TargetModification.cat([f[3] for f in firsts]),
    )
    for j in range(n):
        assert same_row(row(out2[0], j), row(alone[j][1], 0)), ("step 2", j)
    # Step 3: the odd requests have left; the carry rows of the others are selected.
    keep = [j for j in range(n) if j % 2 == 0]
    kept_gens = ([batch_gens[0][j] for j in keep], [batch_gens[1][j] for j in keep])
    out3, *_ = run_requests(
        method, kept_gens, seq3[keep], count3[keep], steps=1, carry=carry3.select(keep)
    )
    for i, j in enumerate(keep):
        assert same_row(row(out3[0], i), row(alone[j][2], 0)), ("step 3", j)


# ---------------------------------------------------------------------------------------------
# Temperature 0: one-hot target and greedy draft -> greedy prefix matching.
# ---------------------------------------------------------------------------------------------


def one_hot_of(fn):
    def g(prefix):
        row = fn(prefix)
        out = [0.0] * len(row)
        out[max(range(len(row)), key=lambda i: (row[i], -i))] = 1.0
        return out

    return g


@pytest.mark.parametrize("method", METHODS)
def test_temperature_zero_is_greedy_prefix_match(method):
    """Spec §11: with a one-hot (T = 0) target and a greedy draft every method accepts the
    longest draft prefix that matches the target's argmax chain and then emits the target's
    argmax; over 3 steps with the carry threaded (the carried modification of a one-hot target
    must stay that target). The 0/0 conventions of spec §11 are all hit here."""
    base, noise = random_rows(SMALL_V, 71, scale=1.5), random_rows(SMALL_V, 72, scale=1.5)
    target = WindowModel.from_fn(SMALL_V, 2, one_hot_of(base))
    # The draft's argmax agrees with the target's on most contexts, not all: τ takes all values.

    def mix(prefix):
        return [0.7 * a + 0.3 * b for a, b in zip(base(prefix), noise(prefix), strict=True)]

    draft = WindowModel.from_fn(SMALL_V, 2, one_hot_of(mix))
    batch = 400
    seq, count = small_contexts(batch, STEPS, seed=73)
    gen = torch.Generator().manual_seed(74)
    carry, taus = None, []
    for _ in range(STEPS):
        x, q, p = draft_block(target, draft, seq, count, k_of(method), SMALL_GAMMA, gen)
        out = verify(method, x, q, p, generator=gen, carry=carry)
        # Greedy prefix match along path 0 (all K greedy paths are identical).
        x0, p0 = x[:, 0], p[:, 0]
        argmax = p0.argmax(-1)  # [B, γ+1]: target's choice after each draft prefix
        tau = (x0 == argmax[:, :SMALL_GAMMA]).long().cumprod(-1).sum(-1)
        expected = torch.full((batch, SMALL_GAMMA + 1), -1, dtype=torch.int64)
        for j in range(batch):
            t = int(tau[j])
            expected[j, :t] = x0[j, :t]
            expected[j, t] = argmax[j, t]
        assert torch.equal(out.num_accepted, tau)
        assert torch.equal(out.tokens, expected)
        check_output(out, x, SMALL_V)
        seq, count = append(seq, count, out)
        carry, taus = out.carry, [*taus, tau]
    seen = set(torch.cat(taus).tolist())
    assert {0, SMALL_GAMMA} <= seen, seen  # both full acceptance and early mismatch occurred


# ---------------------------------------------------------------------------------------------
# Input validation: ValueError naming the problem.
# ---------------------------------------------------------------------------------------------


def valid_inputs(k: int = 1, batch: int = 3):
    seq, count = small_contexts(batch, 1, seed=81)
    x, q, p = draft_block(
        SMALL_TARGET, SMALL_DRAFT, seq, count, k, SMALL_GAMMA, torch.Generator().manual_seed(82)
    )
    return x, q.float(), p.float()


def _bad(name: str, k: int):
    """Inputs (x, q, p, extra kwargs) with one defect; `name` says which."""
    x, q, p = valid_inputs(k)
    kw = {}
    if name == "tokens-2d":
        x = x[:, 0]
    elif name == "tokens-int32":
        x = x.int()
    elif name == "tokens-float":
        x = x.float()
    elif name == "token-out-of-range":
        x = x.clone()
        x[0, 0, 0] = SMALL_V
    elif name == "draft-shape":
        q = q[:, :, :-1]
    elif name == "target-shape":
        p = p[:, :, :-1]
    elif name == "vocab-mismatch":
        p = torch.cat([p, torch.zeros_like(p[..., :1])], dim=-1)
    elif name == "probs-int":
        p = (p > 0.5).long()
    elif name == "nan":
        p = p.clone()
        p[1, 0, 1] = float("nan")
    elif name == "inf":
        q = q.clone()
        q[0, 0, 0, 2] = float("inf")
    elif name == "negative":
        q = q.clone()
        q[0, 0, 1, 0] -= 0.1  # row sum unchanged: only the sign is wrong
        q[0, 0, 1, 1] += 0.1
    elif name == "row-sum":
        p = p.clone()
        p[2, 0, 3] *= 1 + 3 * ROW_SUM_TOL
    elif name == "zero-row":
        p = p.clone()
        p[0, 0, 2] = 0.0
    elif name == "drafted-q-zero":
        q = q.clone()
        q[1, 0, 1, x[1, 0, 1]] = 0.0  # a valid distribution that cannot have drafted x[1, 0, 1]
        q[1, 0, 1] /= q[1, 0, 1].sum()
    elif name == "generators-count":
        kw["generator"] = [torch.Generator() for _ in range(x.shape[0] + 1)]
    else:
        raise KeyError(name)
    return x, q, p, kw


DEFECTS = {
    "tokens-2d": r"draft_tokens must be \[B, K, γ\]",
    "tokens-int32": "draft_tokens must be int64",
    "tokens-float": "draft_tokens must be int64",
    "token-out-of-range": r"draft_tokens must lie in \[0, V",
    "draft-shape": "draft_probs must be",
    "target-shape": "target_probs must be",
    "vocab-mismatch": "target_probs must be",
    "probs-int": "floating dtype",
    "nan": "NaN",
    "inf": "infinite",
    "negative": "negative probabilities",
    "row-sum": "sum to 1",
    "zero-row": "sum to 1",
    "drafted-q-zero": "q = 0",
    "generators-count": "per-request generators",
}


@pytest.mark.parametrize("defect", list(DEFECTS))
@pytest.mark.parametrize("method", METHODS)
def test_invalid_inputs_raise(method, defect):
    x, q, p, kw = _bad(defect, k_of(method, multi=2))
    with pytest.raises(ValueError, match=DEFECTS[defect]):
        verify(method, x, q, p, **kw)


def test_rows_within_tolerance_are_accepted():
    x, q, p = valid_inputs()
    p = p.clone()
    p[2, 0, 3] *= 1 + ROW_SUM_TOL / 4  # off by < ROW_SUM_TOL: a valid (fp16-ish) distribution
    out = verify("token", x, q, p, generator=torch.Generator().manual_seed(0))
    check_output(out, x, SMALL_V)


@pytest.mark.parametrize(
    "defect", ["tokens-2d", "tokens-int32", "draft-shape", "token-out-of-range"]
)
def test_structure_is_checked_even_without_value_validation(defect):
    x, q, p, kw = _bad(defect, 1)
    with pytest.raises(ValueError, match=DEFECTS[defect]):
        verify("block", x, q, p, validate=False, **kw)


def test_unknown_method_raises():
    x, q, p = valid_inputs()
    with pytest.raises(ValueError, match="unknown verification method 'tree'"):
        verify("tree", x, q, p)


@pytest.mark.parametrize("method", [m for m in METHODS if VERIFIERS[m].single_path])
def test_single_path_methods_reject_k_above_one(method):
    x, q, p = valid_inputs(k=2)
    with pytest.raises(ValueError, match="K must be 1"):
        verify(method, x, q, p)


@pytest.mark.parametrize("method", [m for m in METHODS if not VERIFIERS[m].modifies_target])
def test_carry_rejected_by_methods_without_modification(method):
    x1, q1, p1 = valid_inputs(k=1)
    carry = verify("greedy_block", x1, q1, p1, generator=torch.Generator().manual_seed(1)).carry
    assert isinstance(carry, TargetModification)
    x, q, p = valid_inputs(k=k_of(method, multi=2))
    with pytest.raises(ValueError, match="does not modify the target; carry must be None"):
        verify(method, x, q, p, carry=carry)


@pytest.mark.parametrize("method", CARRY_METHODS)
def test_carry_of_another_batch_size_is_rejected(method):
    x, q, p = valid_inputs(k=k_of(method, multi=2))
    with pytest.raises(ValueError, match="carry holds 5 requests"):
        verify(method, x, q, p, carry=TargetModification.empty(5))


# ---------------------------------------------------------------------------------------------
# Residual mass exactly zero (spec §11): valid outputs and the right loop law.
# ---------------------------------------------------------------------------------------------

EDGE_ROWS = {  # last token -> (target row, draft row); Markov on the last token, V = 3
    None: ([0.5, 0.3, 0.2], [0.5, 0.3, 0.2]),  # p == q exactly at the start
    0: ([0.25, 0.25, 0.5], [0.25, 0.25, 0.5]),  # p == q exactly: R = 0, h = 0/0 -> 1
    1: ([0.6, 0.0, 0.4], [0.2, 0.5, 0.3]),  # drafted token 1 has p = 0: p_i hits 0
    2: ([0.0, 0.0, 1.0], [0.3, 0.3, 0.4]),  # one-hot target: drafted 0, 1 rejected surely
}


def edge_pair():
    def row(which):
        return lambda pre: EDGE_ROWS[pre[-1] if pre else None][which]

    return WindowModel.from_fn(3, 1, row(0)), WindowModel.from_fn(3, 1, row(1))


EDGE_N = 50_000


def edge_cases():
    for method in METHODS:
        for k in (1,) if VERIFIERS[method].single_path else (2, 3):
            for dtype in (torch.float32, torch.float64):
                name = str(dtype).removeprefix("torch.")
                yield pytest.param(method, k, dtype, id=f"{method}-K{k}-{name}")


@pytest.mark.parametrize(("method", "k", "dtype"), list(edge_cases()))
def test_zero_residual_edge_cases(method, k, dtype):
    """decode_loop checks every output's structure (no -1 inside the emitted length, tokens in
    range, accepted prefix on a draft path, no NaN in the carry); the law of the first 4 tokens
    must be the target's (γ = 2)."""
    target, draft = edge_pair()
    seed = 300 + 5 * METHODS.index(method) + k + (dtype == torch.float64)
    seq = decode_loop(method_step(method), target, draft, EDGE_N, k, 2, 4, seed, dtype)
    pvalue = loop_law_pvalue(seq, target)
    assert pvalue > ALPHA, (
        f"{method} K={k}: law rejected on the zero-residual instance ({pvalue:.3g})"
    )


@pytest.mark.parametrize("method", METHODS)
def test_equal_rows_single_call(method):
    """p == q everywhere: token/block/greedy accept the whole block; nothing is NaN or -1."""
    x, q, _ = valid_inputs(k=k_of(method, multi=2), batch=32)
    p = torch.cat([q, q[:, :, -1:]], dim=2)  # bonus row: any distribution
    out = verify(method, x, q, p, generator=torch.Generator().manual_seed(3))
    check_output(out, x, SMALL_V)
    if method not in ("naive", "gbv"):
        # Single path: min(1, p/q) = 1 (greedy: premain = prej = 0 -> 1). SpecInfer, SpecTr (ρ = 1,
        # β = 1), traversal (α = 1) and SpecTr-GBV* (its first draft) accept a full path w.p. 1.
        # NSS samples from p and GBV verifies against a skewed q̃ != p: they may stop early.
        assert bool((out.num_accepted == SMALL_GAMMA).all())


def test_spec_names_cover_every_method():
    assert sorted(SPEC_NAMES.values()) == sorted(METHODS)


def test_specinfer_computes_low_precision_rows_in_float32():
    """SpecInfer's residual levels (p - t q)_+ are computed in at least float32: in bfloat16,
    t = 1 + z_1 rounds back to 1 and p - t q cancels where p ≈ q. So bfloat16 rows give exactly
    the tokens of the same values in float32. Rows with p within 0.2% of q (small residual
    masses) and uniforms near 1 (most candidates rejected) reach the deeper levels."""
    from blockspec.verification.backends import choose_backend
    from blockspec.verification.top_down import specinfer_rule

    gen = torch.Generator().manual_seed(0)
    n, vocab, k = 200_000, 8, 4
    q = torch.randn(n, vocab, generator=gen).softmax(-1)
    p = q * (1 + 0.002 * torch.randn(n, vocab, generator=gen))
    p, q = (p / p.sum(-1, keepdim=True)).bfloat16(), q.bfloat16()
    cand = torch.multinomial(q.float(), k, replacement=True, generator=gen)
    u = torch.rand(n, k + 1, generator=gen, dtype=torch.float64)
    u[:, :k] = 0.9 + 0.1 * u[:, :k]
    is_cand = torch.ones(n, k, dtype=torch.bool)
    low = specinfer_rule(choose_backend(q, p), p, q, cand, is_cand, u)
    p32, q32 = p.float(), q.float()
    assert torch.equal(low, specinfer_rule(choose_backend(q32, p32), p32, q32, cand, is_cand, u))


@pytest.mark.parametrize("method", METHODS)
def test_draft_and_target_rows_of_different_dtypes(method):
    """A bfloat16 draft with a float32 target, and the reverse: every method verifies them
    (no in-place arithmetic that cannot hold the promoted result) and emits valid tokens."""
    k = 1 if VERIFIERS[method].single_path else 3
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(4, k, 5, 16, generator=gen).softmax(-1)
    q = (torch.randn(4, k, 4, 16, generator=gen) + p[:, :, :4].log()).softmax(-1)
    tokens = torch.multinomial(q.view(-1, 16), 1, generator=gen).view(4, k, 4)
    for draft, target in [(q.bfloat16(), p), (q, p.bfloat16())]:
        # The engine's path: bfloat16 rows sum to 1 only within ~1e-3, which validation rejects.
        seeded = torch.Generator().manual_seed(1)
        out = verify(method, tokens, draft, target, generator=seeded, validate=False)
        assert ((out.tokens >= 0) & (out.tokens < 16) | (out.tokens == -1)).all()
        assert (out.num_tokens >= 1).all()


def test_specinfer_levels_read_lazily_give_the_same_tokens():
    """On CPU SpecInfer computes a residual level only when some row reaches it, and the
    recovered row only when some row rejected every candidate; on an accelerator it computes
    all of them without host reads. Both give the same tokens, on nodes with 1-4 of the 4
    paths as candidates and uniforms from everything-accepted to everything-rejected."""
    from blockspec.verification import top_down

    gen = torch.Generator().manual_seed(1)
    n, vocab, k = 4000, 12, 4
    q = torch.randn(n, vocab, generator=gen).softmax(-1)
    p = (q.log() + torch.randn(n, vocab, generator=gen)).softmax(-1)
    cand = torch.multinomial(q, k, replacement=True, generator=gen)
    is_cand = torch.rand(n, k, generator=gen) < 0.6
    is_cand[:, 0] = True
    for scale in (0.1, 1.0, 10.0):  # u q / scale against r: most accepted .. most rejected
        u = (torch.rand(n, k + 1, generator=gen, dtype=torch.float64) * scale).clamp_max(0.999)
        lazy = top_down.specinfer_rule(Backend.TORCH_HOST, p, q, cand, is_cand, u)
        every_level = top_down.specinfer_rule(Backend.TORCH_DEVICE, p, q, cand, is_cand, u)
        assert torch.equal(lazy, every_level), scale


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gbv_mass_below_the_path_equals_the_ranked_sums(dtype):
    """C(x_i), the q-mass ranked below each drafted token, summed by one comparison per row
    (no sort) equals the running sum over the row sorted by (p/q, id) at x_i, ties by id
    included: p/q is quantised to a few values, and rows where p = q tie every token."""
    from blockspec.verification import gbv

    gen = torch.Generator().manual_seed(2)
    q = torch.randn(64, 4, 300, generator=gen, dtype=torch.float64).softmax(-1)
    p = torch.randint(1, 5, q.shape, generator=gen) * q  # ratios 1..4: many ties
    p[:, 0] = q[:, 0]  # every ratio equal: the order is the ids'
    p = (p / p.sum(-1, keepdim=True)).to(dtype)
    q = q.to(dtype)
    x = torch.multinomial(q.view(-1, 300).double(), 1, generator=gen).view(64, 4)
    key = gbv.ranking_key(p, q)
    ranked = gbv.mass_ranked_below(key.view(-1, 300), q.view(-1, 300)).view(q.shape)
    expected = ranked.gather(-1, x.unsqueeze(-1)).squeeze(-1)
    got = gbv.drafted_mass_below(key, q, x, Backend.TORCH_HOST)
    assert torch.allclose(
        got.double(), expected.double(), rtol=1e-12 if dtype == torch.float64 else 1e-6, atol=0
    )


def _kseq_f(p, q, rho, n):
    """f(ρ) = ρ β - 1 + (1 - β)^n and β = Σ min(q, p/ρ), summed directly in float64."""
    beta = torch.minimum(q.double(), p.double() / rho[:, None]).sum(-1)
    return rho * beta - 1 + (1 - beta).clamp_min(0) ** n, beta


@pytest.mark.parametrize("search", ["narrow", "wide", "cuda"])
@pytest.mark.parametrize("reads_free", [True, False], ids=["cpu-path", "accelerator-path"])
def test_kseq_rho_is_the_smallest_feasible_ratio(monkeypatch, reads_free, search):
    """SpecTr's ρ* (spec §7) is the smallest ρ in [1, n] with f(ρ) = ρ β(ρ) - 1 + (1 - β)^n >= 0,
    β(ρ) = Σ min(q, p/ρ): feasible (lossless) and, unless 1, within 1e-8 of the root
    (acceptance). Checked against β summed directly, on dense rows, rows with tied ratios,
    p = q (ρ* = 1 exactly), and rows zero outside a small draft support, with nodes of one
    candidate (ρ* = 1) among them; both on CPU's path (those nodes picked out) and on the
    accelerators' (every row solved at once), with the CPU's narrow search, the GPU's wide
    one and the CUDA kernels' grid (taken here on CPU; 2^28 parts: within 6e-8 of it)."""
    from blockspec.verification import top_down

    backend = Backend.NUMBA if reads_free else Backend.TORCH_DEVICE

    def kseq_rho(p, q, n):
        return top_down.kseq_rho(p, q, n, backend)

    if search != "narrow":
        grid = top_down.SEARCH_WIDE if search == "wide" else top_down.SEARCH_CUDA
        monkeypatch.setattr(top_down, "SEARCH_NARROW", grid)
    tol = 6e-8 if search == "cuda" else 1e-8

    gen = torch.Generator().manual_seed(5)
    rows, vocab = 64, 3000
    logits = torch.randn(rows, vocab, generator=gen) * 2
    cases = {
        "dense": (logits, logits + torch.randn(rows, vocab, generator=gen)),
        "ties": (logits.round(), (logits + torch.randn(rows, vocab, generator=gen)).round()),
        "support": (
            logits,
            logits + torch.where(torch.rand(vocab, generator=gen) < 0.2, 0, -torch.inf),
        ),
    }
    for name, (p_logits, q_logits) in cases.items():
        p, q = p_logits.softmax(-1), q_logits.softmax(-1)
        for n in (2, 3, 5):
            count = torch.full((rows,), n)
            count[::3] = 1  # nodes with one candidate among them: ρ* = 1
            rho, beta = kseq_rho(p, q, count)
            assert (rho[::3] == 1).all(), name

            f_rho, b_rho = _kseq_f(p, q, rho, count.double())
            assert (f_rho >= -1e-7).all(), (name, n, f_rho.min())
            assert torch.allclose(beta, b_rho, atol=1e-7), name
            # Within tol of the root (the search's grid is 2^-32 of [1, n]), against f with q
            # summed to exactly 1 as the solver sums it (float32 rows are off by ~1e-8).
            q_unit = q.double() / q.double().sum(-1, keepdim=True)
            above_one = rho > 1 + tol
            f_below = _kseq_f(p, q_unit, rho * (1 - tol), count.double())[0]
            assert (f_below[above_one] < 0).all(), (name, n)
    p = logits.softmax(-1)
    rho, beta = kseq_rho(p, p, torch.full((rows,), 3))
    assert (rho == 1).all() and torch.allclose(beta, torch.ones_like(beta))
    rho, beta = kseq_rho(p, q, torch.ones(rows, dtype=torch.int64))  # all TV
    assert (rho == 1).all() and torch.allclose(beta, _kseq_f(p, q, rho, 1)[1])
