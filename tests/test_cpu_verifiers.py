"""The whole-verifier loops (each verifier's loops.py: the numba backend, float32 CPU rows)
against the verifiers' torch ops (the torch-host backend): the same tokens, τ and paths on
trees of every regime.

The loops sum in float64 in their own order and take exp/log from libm, so a uniform within a
few float32 ulps of a threshold could go the other way; with these seeds none does, and the
mutants of the loops that were tried (a wrong uniform, level or running product, ties broken
the wrong way, a deletion's bookkeeping left out; in greedy BV a record's joint one token
off, one unforced row left unmodified, a level's joint or a forced row's one-hot dropped, ties
in |A| taken by the later draft) all fail here.
"""

from __future__ import annotations

import pytest
import torch

from blockspec.verification import VERIFIERS, Backend, verify
from blockspec.verification.modification import apply_records

VOCABS = [7, 300, 5003]  # below and above one vector of lanes, and no multiple of one


def drafted_tree(vocab: int, b: int, k: int, gamma: int, regime: str, seed: int):
    """A batch of draft trees whose rows are a function of their prefix (paths that share a
    prefix share its rows): tokens [b, k, γ], q [b, k, γ, V], p [b, k, γ+1, V] float32. Peaked
    rows, so that paths share prefixes at any vocabulary. realistic: q = p perturbed; agree:
    q = p (long acceptances); disjoint: q reversed (deletions all the way to the root)."""
    gen = torch.Generator().manual_seed(seed)
    cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def node(prefix: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        if prefix not in cache:
            logits = torch.randn(vocab, generator=gen, dtype=torch.float64) * 5
            noise = torch.randn(vocab, generator=gen, dtype=torch.float64)
            q_logits = {
                "realistic": logits + noise,
                "agree": logits,
                "disjoint": -logits,
            }[regime]
            cache[prefix] = (logits.softmax(-1).float(), q_logits.softmax(-1).float())
        return cache[prefix]

    tokens = torch.empty(b, k, gamma, dtype=torch.int64)
    q = torch.empty(b, k, gamma, vocab)
    p = torch.empty(b, k, gamma + 1, vocab)
    for r in range(b):
        for j in range(k):
            prefix = (r,)
            for d in range(gamma + 1):
                p[r, j, d], q_row = node(prefix)
                if d < gamma:
                    q[r, j, d] = q_row
                    tokens[r, j, d] = torch.multinomial(q_row.double(), 1, generator=gen).item()
                    prefix += (int(tokens[r, j, d]),)
    return tokens, q, p


def same_as_the_torch_ops(method, tokens, q, p, uniforms) -> list[tuple]:
    """method's outputs with each set of uniforms on the numba backend (the CPU loops) and then
    on torch-host (its torch ops): asserts they are equal, returns the loops'."""

    def run(backend: Backend, u: torch.Tensor) -> tuple:
        return VERIFIERS[method].implementations[backend](backend, tokens, q, p, u)

    got = [run(Backend.NUMBA, u) for u in uniforms]
    for u, out in zip(uniforms, got, strict=True):
        for a, b in zip(out, run(Backend.TORCH_HOST, u), strict=True):
            assert torch.equal(a, b)
    return got


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("regime", ["realistic", "agree", "disjoint"])
def test_traversal_walk_gives_the_torch_walks_tokens(vocab, k, regime):
    """The walk as one loop a request against traversal_verify's batched torch segments: the
    same τ, path and tokens (y included, drawn from the row the walk stopped at) for 4 × 32
    trees with shared prefixes, duplicate paths and deletions down to the root. Its sums are
    float64 where torch's are float32, so a test whose uniform lies within ~1e-7 of its α
    could go the other way; none does here."""
    tokens, q, p = drafted_tree(vocab, 32, k, 5, regime, seed=vocab + k)
    gen = torch.Generator().manual_seed(k)
    uniforms = [torch.rand(32, k * 5 + 2, generator=gen, dtype=torch.float64) for _ in range(4)]
    same_as_the_torch_ops("traversal", tokens, q, p, uniforms)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("regime", ["realistic", "agree", "disjoint"])
def test_gbv_loops_give_the_torch_ops_tokens(vocab, k, regime):
    """gbv.loops.gbv_verify against gbv_verify_lazily's torch ops (_verify_lazily): the same
    selected path, τ and tokens for 4 × 32 trees, from τ = γ to deep rounds of levels. Its sums
    are float64 in its own order and its exp/log libm's, so a uniform within a few float32
    ulps of its threshold could go the other way; none does here."""
    tokens, q, p = drafted_tree(vocab, 32, k, 5, regime, seed=vocab + k)
    gen = torch.Generator().manual_seed(k)
    uniforms = [torch.rand(32, 6, generator=gen, dtype=torch.float64) for _ in range(4)]
    same_as_the_torch_ops("gbv", tokens, q, p, uniforms)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("regime", ["realistic", "agree", "disjoint"])
def test_block_loop_gives_the_torch_ops_tokens(vocab, regime):
    """block.loops.block_verify (also GBV's and traversal's K = 1) against
    block_verify_torch_rows' torch ops, which sum every level's mass in one pass: the same τ
    and tokens for 4 × 32 chains, every τ from 0 to γ among them."""
    tokens, q, p = drafted_tree(vocab, 32, 1, 5, regime, seed=vocab)
    gen = torch.Generator().manual_seed(vocab)
    uniforms = [torch.rand(32, 6, generator=gen, dtype=torch.float64) for _ in range(4)]
    got = same_as_the_torch_ops("block", tokens, q, p, uniforms)
    seen = {int(t) for out in got for t in out[1]}
    assert seen == {"realistic": set(range(6)), "agree": {5}, "disjoint": {0}}[regime]


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("method", ["spectr", "specinfer"])
@pytest.mark.parametrize("regime", ["realistic", "agree", "disjoint"])
def test_walk_draws_give_the_torch_ops_tokens(vocab, k, method, regime):
    """The walks' draws as loops a row (top_down.loops.recovered_tokens: token verification's
    recovered or bonus token below a one-path node; kseq_residual_tokens: SpecTr's residual
    at the undecided nodes) against their torch ops: the same tokens for 8 seeds of 32 trees
    (agree: q = p, every residual empty, p drawn instead; disjoint: residuals at the root)."""
    tokens, q, p = drafted_tree(vocab, 32, k, 5, regime, seed=vocab + k)
    runs = []
    for backend in ("numba", "torch-host"):
        gens = [torch.Generator().manual_seed(s) for s in range(8)]
        runs.append(
            [verify(method, tokens, q, p, g, validate=False, backend=backend) for g in gens]
        )
    for ours, theirs in zip(*runs, strict=True):
        assert torch.equal(ours.tokens, theirs.tokens) and torch.equal(ours.path, theirs.path)


def same_carried_joints(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Log-joints equal up to a float32 sum's rounding (the loops sum the masses z in float64
    in their own order, torch in float32 in its), infinities in the same places."""
    finite = a.isfinite()
    return (
        torch.equal(finite, b.isfinite())
        and torch.equal(a[~finite], b[~finite])
        and bool(torch.allclose(a[finite], b[finite], rtol=1e-5, atol=1e-5))
    )


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("regime", ["realistic", "agree", "disjoint"])
def test_greedy_loops_give_the_torch_ops_tokens(vocab, k, regime):
    """greedy.loops.greedy_verify and apply_records against the torch ops of greedy BV
    (K = 1) and SpecTr-GBV*: 5 steps of 32 trees, each verifying against the modification
    carried from the step before (up to 5 steps' records live at once). The same τ, paths,
    tokens and record windows; the records' log-joints within a float32 sum's rounding."""
    method = "greedy_block" if k == 1 else "spectr_gbv"
    tokens, q, p = drafted_tree(vocab, 32, k, 6, regime, seed=vocab + k)
    runs = []
    for backend in ("numba", "torch-host"):
        carry, run = None, []
        for step in range(5):
            gen = torch.Generator().manual_seed(step)
            out = verify(method, tokens, q, p, gen, carry=carry, validate=False, backend=backend)
            carry = out.carry
            run.append(out)
        runs.append(run)
    for ours, theirs in zip(*runs, strict=True):
        for field in ("tokens", "path"):
            assert torch.equal(getattr(ours, field), getattr(theirs, field))
        assert torch.equal(ours.carry.rows_left, theirs.carry.rows_left)
        assert same_carried_joints(ours.carry.log_p, theirs.carry.log_p)
        assert same_carried_joints(ours.carry.log_q, theirs.carry.log_q)


@pytest.mark.parametrize("vocab", VOCABS)
def test_apply_records_loop_gives_the_torch_ops_rows(vocab):
    """cpu_kernels.apply_records against modification.apply_records' torch ops on a carry of
    4 steps of SpecTr-GBV* at K = 3: every modified row's offset t and mass z, and every
    record's base rows, equal up to a float32 sum's rounding."""
    tokens, q, p = drafted_tree(vocab, 16, 3, 6, "realistic", seed=vocab)
    carry = None
    for step in range(4):
        gen = torch.Generator().manual_seed(step)
        carry = verify("spectr_gbv", tokens, q, p, gen, carry=carry, validate=False).carry
    assert carry.max_rows > 0
    ours = apply_records(carry, tokens, q, p, Backend.NUMBA)
    theirs = apply_records(carry, tokens, q, p, Backend.TORCH_HOST)
    for a, b in zip(ours, theirs, strict=True):
        assert a.t.shape == b.t.shape
        assert torch.allclose(a.t, b.t, rtol=1e-5) and torch.allclose(a.z, b.z, rtol=1e-5)
    assert not torch.equal(ours[0].t, torch.zeros_like(ours[0].t))  # some row was modified
