"""Launch and host-wait budgets of one ``verify`` call per method.

Speed itself is measured by ``blockspec-bench verify`` (docs/verification_benchmark.md); these
tests pin what makes it scale: the number of tensor operations a call dispatches (each one a
kernel launch on an accelerator, ~5 µs of Python and dispatch on CPU) and the number that need
the host to wait for the device (``.item()``/``bool()``, ``nonzero``, boolean-mask indexing).
Both are counted on CPU with a dispatch mode, so a change that adds a per-token or per-candidate
loop, or a sync inside one, fails here without a GPU; where CUDA is present the real waits are
counted with ``torch.cuda.set_sync_debug_mode`` as well.

Budgets are formulas in K and γ, stated per method with the reason for each growth term: the
loops that remain are the sequential ones of the math (top-down walks over depth, SpecInfer's
candidates at a node, traversal's leaves); everything else is one batched pass.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from blockspec.verification import METHODS, VERIFIERS, Backend, VerifyGraphs, top_down, verify

# Ops whose result the host must read before it can go on: on an accelerator, a wait.
HOST_READS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select"}
MASK_INDEXING = {"aten::index", "aten::index_put", "aten::index_put_"}


def op_budget(method: str, k: int, gamma: int) -> int:
    """Dispatched operations per call, any batch size (V = 64 here; V does not enter)."""
    depths = gamma + 1
    return {
        "token": 80,
        "block": 120,
        # The selection compares one key per depth ([B, K] ops). At K > 1 the levels of block
        # verification are tried top-down on CPU, one batched ranking of a row per round for the
        # requests still undecided: at most γ rounds (levels γ-1..0).
        "gbv": 160 + 25 * gamma if k == 1 else 200 + 25 * gamma + 75 * gamma,
        # K levels of one batched pass each (SpecTr-GBV*'s levels are sequential in k); level
        # 0 has no forced prefix yet, so it skips that bookkeeping. On CPU a level's masses
        # are summed top-down for the requests still undecided: at most γ - 1 rounds a level.
        "greedy_block": 60 + 170 * k + 45 * k * gamma,
        "spectr_gbv": 60 + 170 * k + 45 * k * gamma,
        # Top-down walks: one node per depth, sequential by definition.
        "naive": 80 + 30 * depths,
        # RRS: the residual after j rejections, one mass per level j = 1..K in turn (its
        # closed form needs no per-candidate row updates); one candidate a node is TV.
        "specinfer": 80 if k == 1 else 100 + depths * (60 + 25 * k),
        # + the ρ* solve: one sort, then 8 rounds of one batched search each (on CPU)
        "spectr": 80 if k == 1 else 100 + depths * (80 + 20 * k + 250),
        # One segment per distinct leaf, in post-order: the leaf's chain of deletions up to the
        # next branch is one batched pass (its updates read only the state before it).
        "traversal": 100 + 200 * k,
    }[method]


def host_read_budget(method: str, k: int, gamma: int, device: str = "cpu") -> int:
    """Would-be host waits per call; 1 is the draft-token range check of every call.

    Off the CPU a verifier reads nothing else back (the walks mask finished requests instead
    of dropping them, the ρ* search runs all its rounds), so its kernels can replay from a CUDA
    graph; only the carried modification's bookkeeping, outside the graph, reads counts. On
    CPU, where a read is free, verifiers read flags to skip or compact work."""
    depths = gamma + 1
    if device != "cpu" and not VERIFIERS[method].modifies_target:
        return 1
    return {
        "token": 1,
        "block": 1,
        # + at K > 1: whether the draft's support is small enough to rank alone (one row's
        # count; on a small one its size and whether it holds the path), and per round of
        # levels (≤ γ): whether any request is undecided, which, and which passed; + 1 last.
        "gbv": 1 if k == 1 else 5 + 3 * gamma,
        # + carry bookkeeping: how many rows the records still modify, and dropping the records
        # that died this step (a test, then a masked select of each of the 3 columns); and
        # per level k, which requests' top level needs its masses, once a round (≤ γ).
        "greedy_block": 6 + k * gamma,
        "spectr_gbv": 6 + k * gamma,
        "naive": 1 + depths,  # the walk drops finished requests at each depth
        # + whether a row still reads level j (j = 1..K), or the recovered row
        "specinfer": 1 if k == 1 else 1 + depths * (k + 2),
        # + a node's: the walk's compaction, which rows have several candidates and the
        # draft's support (ρ*, ≤ 2), whether any row needs the residual
        "spectr": 1 if k == 1 else 1 + depths * 5,
        "traversal": 1 + 3 * k,  # each segment splits the live requests; modified rows
    }[method]


class CountOps(TorchDispatchMode):
    """Counts dispatched aten ops and those that read device values on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.host_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        self.ops += 1
        masked = name in MASK_INDEXING and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None
        )
        if name in HOST_READS or masked:
            self.host_reads += 1
        return func(*args, **(kwargs or {}))


def inputs(regime: str, b: int, k: int, gamma: int, vocab: int = 64, device: str = "cpu"):
    """realistic: per-position acceptance ~0.6; agree: p = q (everything accepted, the longest
    walks); disjoint: q puts its mass where p has little (everything rejected, the most
    deletion steps)."""
    gen = torch.Generator(device).manual_seed(7)
    logits = torch.randn(b, k, gamma + 1, vocab, generator=gen, device=device) * 3
    logits[:, 1:, 0] = logits[:, :1, 0]
    if regime == "agree":
        q_logits = logits[:, :, :gamma]
    elif regime == "disjoint":
        q_logits = -logits[:, :, :gamma]
    else:
        q_logits = logits[:, :, :gamma] + torch.randn(
            b, k, gamma, vocab, generator=gen, device=device
        )
    q, p = q_logits.softmax(-1), logits.softmax(-1)
    tokens = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).view(b, k, gamma)
    return tokens, q, p


SHAPES = [(1, 4), (1, 8), (2, 8), (4, 4), (4, 8)]
CASES = [(m, k, g) for m in METHODS for k, g in SHAPES if not (VERIFIERS[m].single_path and k > 1)]


@pytest.mark.parametrize("regime", ["realistic", "agree", "disjoint"])
@pytest.mark.parametrize(("method", "k", "gamma"), CASES)
def test_ops_and_host_reads_within_budget(method, k, gamma, regime):
    tokens, q, p = inputs(regime, 8, k, gamma)
    counter = CountOps()
    with counter:
        verify(method, tokens, q, p, generator=torch.Generator().manual_seed(1), validate=False)
    assert counter.ops <= op_budget(method, k, gamma), counter.ops
    assert counter.host_reads <= host_read_budget(method, k, gamma), counter.host_reads


def test_batched_passes_do_not_grow_with_the_tree(monkeypatch):
    """token, block, greedy_block and spectr_gbv (at a given K): the same ops at every γ, up to
    a few of carry bookkeeping (their levels are batched over depth and over paths). On CPU
    greedy BV sums a level's masses lazily, in rounds; its accelerator path is counted."""
    take_accelerator_paths(monkeypatch)
    counts = {}
    for method, k in [("token", 1), ("block", 1), ("greedy_block", 1), ("spectr_gbv", 4)]:
        for gamma in (2, 8, 16):
            tokens, q, p = inputs("realistic", 8, k, gamma)
            counter = CountOps()
            with counter:
                verify(
                    method, tokens, q, p, generator=torch.Generator().manual_seed(1), validate=False
                )
            counts.setdefault(method, set()).add(counter.ops)
    assert all(max(c) - min(c) <= 5 for c in counts.values()), counts


def test_the_counter_sees_host_reads():
    """The counter itself: .item(), nonzero and a boolean mask each count once."""
    x = torch.arange(6)
    counter = CountOps()
    with counter:
        _ = x.sum().item()
        _ = x.nonzero()
        _ = x[x > 2]
    assert counter.host_reads == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts real waits on a CUDA device")
@pytest.mark.parametrize("method", METHODS)
def test_cuda_host_waits_within_budget(method):
    k, gamma = (1 if VERIFIERS[method].single_path else 4), 8
    tokens, q, p = inputs("realistic", 32, k, gamma, vocab=32000, device="cuda")
    gen = torch.Generator("cuda").manual_seed(1)
    verify(method, tokens, q, p, generator=gen, validate=False)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            verify(method, tokens, q, p, generator=gen, validate=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    waits = sum("synchroniz" in str(w.message) for w in caught)
    assert waits <= host_read_budget(method, k, gamma, "cuda"), waits


@pytest.mark.parametrize("vocab", [3, 64])
@pytest.mark.parametrize("regime", ["realistic", "agree", "disjoint"])
@pytest.mark.parametrize("method", ["specinfer", "spectr"])
def test_one_candidate_a_node_skips_the_walk_with_the_same_draws(method, regime, vocab):
    """At K = 1 SpecInfer and SpecTr are token verification (spec §6, §7) and run it over the
    whole path at once, reading the uniforms the walk would: the same seeds give the same
    tokens, τ and path as the per-depth walk."""
    tokens, q, p = inputs(regime, 256, 1, 8, vocab)
    uniforms = torch.rand(
        256, 9 * 2, generator=torch.Generator().manual_seed(3), dtype=torch.float64
    )
    rule = {"specinfer": top_down.specinfer_rule, "spectr": top_down.spectr_rule}[method]
    walked = top_down.walk_tree(rule, Backend.NUMBA, tokens, q, p, uniforms)
    fast = VERIFIERS[method].implementations[Backend.NUMBA](Backend.NUMBA, tokens, q, p, uniforms)
    for a, b in zip(walked, fast, strict=True):
        assert torch.equal(a, b)


# Off the CPU the verifiers read no flags back to skip work: fixed-shape paths, so that a
# call's kernels can be captured in a CUDA graph. They are checked here on CPU by taking them.


def same_tokens(a, b) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("tokens", "num_tokens", "path"))


def take_accelerator_paths(monkeypatch) -> None:
    """Run the verifiers' accelerator paths on CPU: verify's backend is the fixed-shape torch
    ops' (torch-device), no host reads to skip or compact work."""
    from blockspec import verification

    monkeypatch.setattr(verification, "choose_backend", lambda q, p: Backend.TORCH_DEVICE)


WALKS = [m for m in METHODS if not VERIFIERS[m].single_path]


@pytest.mark.parametrize("regime", ["realistic", "agree", "disjoint"])
@pytest.mark.parametrize("method", WALKS)
def test_accelerator_paths_give_the_cpu_tokens(method, regime, monkeypatch):
    """The fixed-shape paths (every request at every depth, masked; every node's ρ* solved)
    that make a walk capturable pick the same tokens as the CPU's compacting ones."""
    tokens, q, p = inputs(regime, 64, 4, 5, vocab=6)  # a narrow vocabulary: shared prefixes
    gen = torch.Generator()
    cpu = [verify(method, tokens, q, p, gen.manual_seed(s)) for s in range(8)]
    take_accelerator_paths(monkeypatch)
    for s, ref in enumerate(cpu):
        assert same_tokens(ref, verify(method, tokens, q, p, gen.manual_seed(s))), s


F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16


@pytest.mark.parametrize("dtypes", [(F64, F64), (F32, F32), (BF16, BF16), (F32, F64), (F64, F32)])
@pytest.mark.parametrize("support", [None, 90])
@pytest.mark.parametrize("regime", ["realistic", "agree", "disjoint"])
def test_gbv_ranks_only_the_levels_its_uniforms_reach(regime, support, dtypes, monkeypatch):
    """GBV on CPU ranks a row only where its level can pass (η_i < p_i Σp) and tries the levels
    top-down; the accelerator path ranks every row. Both give the same tokens, in every dtype
    (draft and target rows of different dtypes too) and with a draft support smaller than the
    vocabulary (a reduced head, ranked alone)."""
    tokens, q, p = inputs(regime, 96, 3, 6, vocab=200)
    if support is not None:  # a reduced draft head: the draft knows the first ids only
        q = torch.cat([q[..., :support], torch.zeros_like(q[..., support:])], dim=-1)
        q = q / q.sum(-1, keepdim=True)
        gen = torch.Generator().manual_seed(4)
        tokens = torch.multinomial(q.view(-1, 200), 1, generator=gen).view(tokens.shape)
    q, p = q.to(dtypes[0]), p.to(dtypes[1])
    gen = torch.Generator()
    cpu = [verify("gbv", tokens, q, p, gen.manual_seed(s), validate=False) for s in range(6)]
    take_accelerator_paths(monkeypatch)
    for s, ref in enumerate(cpu):
        assert same_tokens(ref, verify("gbv", tokens, q, p, gen.manual_seed(s), validate=False))


@pytest.mark.parametrize("dtypes", [(F64, F64), (F32, F32), (BF16, BF16), (F32, F64)])
@pytest.mark.parametrize("regime", ["realistic", "agree", "disjoint"])
@pytest.mark.parametrize(("method", "k"), [("greedy_block", 1), ("spectr_gbv", 3)])
def test_greedy_levels_summed_lazily_give_the_same_tokens(method, k, regime, dtypes, monkeypatch):
    """Greedy BV on CPU sums a level's masses only where its test can pass (η_i below
    Σm / (s Σq)) and tries the levels top-down; the accelerator path sums every level. Both
    give the same tokens over 4 steps that thread the carried modification (modified rows)."""
    tokens, q, p = inputs(regime, 64, k, 5, vocab=40)
    q, p = q.to(dtypes[0]), p.to(dtypes[1])
    runs = []
    for accelerator in (False, True):
        with monkeypatch.context() as patch:
            if accelerator:
                take_accelerator_paths(patch)
            carry, run = None, []
            for step in range(4):
                gen = torch.Generator().manual_seed(step)
                out = verify(method, tokens, q, p, gen, carry=carry, validate=False)
                carry = out.carry
                run += [out.tokens, out.num_tokens, out.path]
            runs.append(run)
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_gbv_levels_compare_uniforms_in_the_promoted_dtype():
    """float32 target rows, float64 draft rows: block verification compares η with h in
    float64. A uniform a hair below p_γ (which rounds up to p_γ in float32) passes level γ on
    both of GBV's paths."""
    from blockspec.verification import gbv

    tokens, q, p = inputs("agree", 32, 2, 4, vocab=50)
    tokens[:, 1], q[:, 1], p[:, 1] = tokens[:, 0], q[:, 0], p[:, 0]  # both paths equal: path 0
    q, p = q.double(), p.float()
    below_x, q_x, p_x = gbv._path_values(q[:, 0], p[:, 0], tokens[:, 0], Backend.TORCH_HOST)
    _, q_tilde_x = gbv._skew_at_path(below_x, q_x, 2)
    pi_last = gbv.running_products(p_x, q_tilde_x, p.dtype)[:, -1].double()
    u = torch.rand(32, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    u[:, 3] = pi_last - 1e-12
    lazy = gbv.gbv_verify_lazily(Backend.TORCH_HOST, tokens, q, p, u)
    every_level = gbv.gbv_verify_all_levels(Backend.TORCH_DEVICE, tokens, q, p, u)
    assert (every_level[1] == 4).all()
    assert all(torch.equal(a, b) for a, b in zip(lazy, every_level, strict=True))


def test_rho_solve_gives_the_same_bits_on_every_row_at_once():
    """Solving the rows with several candidates only (CPU) or every row at once (accelerators)
    gives the same ρ* and β, bit for bit: a row's search reads nothing but its own row."""
    from blockspec.verification import top_down

    gen = torch.Generator().manual_seed(3)
    p = (torch.randn(64, 300, generator=gen) * 3).softmax(-1)
    q = p.log() + torch.randn(64, 300, generator=gen) * torch.rand(64, 1, generator=gen) * 4
    q = q.softmax(-1)
    n = torch.randint(1, 6, (64,), generator=gen)
    rho, beta = top_down.kseq_rho(p, q, n, Backend.TORCH_HOST)
    rho_all, beta_all = top_down.kseq_rho(p, q, n, Backend.TORCH_DEVICE)
    assert torch.equal(rho, rho_all) and torch.equal(beta[n > 1], beta_all[n > 1])


@pytest.mark.parametrize("regime", ["realistic", "disjoint"])
@pytest.mark.parametrize("method", METHODS)
def test_accelerator_paths_read_nothing_back(method, regime, monkeypatch):
    """What makes a call capturable: no host read but the range check (and, outside the
    graph, the carried modification's bookkeeping)."""
    k = 1 if VERIFIERS[method].single_path else 4
    tokens, q, p = inputs(regime, 8, k, 6)
    take_accelerator_paths(monkeypatch)
    counter = CountOps()
    with counter:
        verify(method, tokens, q, p, torch.Generator().manual_seed(0), validate=False)
    assert counter.host_reads <= host_read_budget(method, k, 6, "cuda"), counter.host_reads


def test_stable_sort_gives_the_packed_sorts_order():
    """Off the CPU ascending_order sorts the float32 key itself (stable): the same (key, id)
    order as the CPU's packed words, ties, zeros and +inf included."""
    from blockspec.verification.sorting import ascending_order

    gen = torch.Generator().manual_seed(5)
    key = torch.randint(0, 7, (16, 3000), generator=gen).float() / 4  # many ties
    key[:, ::11] = torch.inf
    key[3] = 0.0
    key[5] = torch.rand(3000, generator=gen) * 1e-30  # tiny and denormal ratios
    assert torch.equal(ascending_order(key), torch.sort(key, dim=-1, stable=True).indices)


@pytest.mark.parametrize(("method", "k"), [("greedy_block", 1), ("spectr_gbv", 2)])
def test_an_accelerators_carry_keeps_one_width_from_the_first_step(method, k, monkeypatch):
    """Verified from graphs off the CPU, a carry has its bound's width, γK columns, from the
    first step (dead ones first), so a verify graph keyed by its shape is captured once, not
    once a step while records accumulate; the tokens stay the CPU's, step after step."""
    gamma, steps = 4, 6
    draws = [inputs("realistic", 16, k, gamma, vocab=12) for _ in range(steps)]
    gens = [torch.Generator().manual_seed(s) for s in range(steps)]

    def chain() -> list:
        carry, outs = None, []
        for (tokens, q, p), gen in zip(draws, gens, strict=True):
            seeded = gen.manual_seed(gen.initial_seed())
            out = verify(method, tokens, q, p, seeded, carry=carry, graphs=VerifyGraphs())
            outs.append(out)
            carry = out.carry
        return outs

    cpu = chain()
    take_accelerator_paths(monkeypatch)
    device = chain()
    assert [out.carry.rows_left.shape[1] for out in device] == [gamma * k] * steps
    for ref, out in zip(cpu, device, strict=True):
        assert same_tokens(ref, out)
