"""Test harness: explicit conditional-table models, batched drafting, exact laws, chi-square.

A *table model* maps every prefix (tuple of token ids, relative to the context) to a
distribution over V tokens. Drafting, row gathering and verification all run batched: one
batch element per independent trial.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections import Counter
from functools import cache
from pathlib import Path

import numpy as np
import torch
from scipy import stats

from blockspec.verification.tensors import sample_from_weights

# The reference instances and their exact laws (docs/verification.md §12); they are recomputed
# by tests/reference_laws.py (tests/test_reference_numbers.py runs its check).
REFERENCE_DIR = Path(__file__).resolve().parent / "reference"

# Spec names -> registry names.
SPEC_NAMES = {
    "TV": "token",
    "BV": "block",
    "GreedyBV": "greedy_block",
    "NSS": "naive",
    "SpecInfer": "specinfer",
    "SpecTr": "spectr",
    "GBV": "gbv",
    "Traversal": "traversal",
    "SpecTr-GBV*": "spectr_gbv",
}

# Where the verifiers run (the tables, drafting and counting stay on the CPU):
# BLOCKSPEC_TEST_DEVICE=cuda checks the same laws on a GPU (scripts/gpu_checks.sh).
DEVICE = torch.device(os.environ.get("BLOCKSPEC_TEST_DEVICE", "cpu"))
# On CUDA the verifiers replay from CUDA graphs, as the service runs them there
# (BLOCKSPEC_TEST_GRAPHS=0: eager).
GRAPHS = None
if DEVICE.type == "cuda" and os.environ.get("BLOCKSPEC_TEST_GRAPHS", "1") != "0":
    from blockspec.verification import VerifyGraphs

    GRAPHS = VerifyGraphs()

# Significance level of every law test. The tests are seeded (deterministic), so a pass is
# reproducible; the level keeps the family of ~150 law tests from failing by chance when a
# seed changes (expected false alarms per full run ~0.015).
ALPHA = 1e-4


@cache
def load_reference():
    instances = json.loads((REFERENCE_DIR / "reference_instances.json").read_text())
    numbers = json.loads((REFERENCE_DIR / "reference_numbers.json").read_text())
    return instances, numbers


class TableModel:
    """Conditional tables over prefixes of length <= max_len, stored as one [N, V] tensor.

    ``fn(prefix) -> list[float]`` defines the conditionals; index of a prefix of length n with
    digits d_i is offset(n) + Σ d_i V^(n-1-i).
    """

    def __init__(self, vocab: int, max_len: int, fn, dtype=torch.float64):
        self.V, self.max_len = vocab, max_len
        self.offsets = [sum(vocab**j for j in range(n)) for n in range(max_len + 2)]
        rows = []
        for n in range(max_len + 1):
            for idx in range(vocab**n):
                prefix = tuple((idx // vocab ** (n - 1 - i)) % vocab for i in range(n))
                rows.append(fn(prefix))
        self.table = torch.tensor(rows, dtype=dtype)
        self.table = self.table / self.table.sum(-1, keepdim=True)

    @staticmethod
    def from_json(tables: dict, vocab: int, max_len: int) -> TableModel:
        return TableModel(vocab, max_len, lambda pre: tables[",".join(map(str, pre))])

    def index(self, prefix: torch.Tensor, length: int) -> torch.Tensor:
        """prefix [..., >= length] int64 -> table index of its first `length` tokens."""
        idx = torch.zeros(prefix.shape[:-1], dtype=torch.int64)
        for i in range(length):
            idx = idx * self.V + prefix[..., i]
        return idx + self.offsets[length]

    def rows(self, prefix: torch.Tensor, lengths: range) -> torch.Tensor:
        """[..., L] prefix -> [..., len(lengths), V] conditional rows after each length."""
        return torch.stack([self.table[self.index(prefix, n)] for n in lengths], dim=-2)

    def prob(self, seq: tuple[int, ...]) -> float:
        """Exact probability of a token sequence from the empty prefix."""
        prob = 1.0
        for i, tok in enumerate(seq):
            prob *= float(self.table[self.offsets[i] + _digits_index(seq[:i], self.V), tok])
        return prob


def _digits_index(prefix, vocab):
    idx = 0
    for d in prefix:
        idx = idx * vocab + d
    return idx


def sample_paths(
    draft: TableModel, n: int, k: int, gamma: int, gen: torch.Generator
) -> torch.Tensor:
    """[n, k, γ] i.i.d. paths from the draft tables (from the empty prefix)."""
    tokens = torch.zeros(n, k, gamma, dtype=torch.int64)
    for i in range(gamma):
        rows = draft.table[draft.index(tokens, i)]  # [n, k, V]
        tokens[:, :, i] = torch.multinomial(rows.view(-1, draft.V), 1, generator=gen).view(n, k)
    return tokens


def one_iteration(method, target, draft, n, k, gamma, seed, dtype=torch.float32, chunk=50_000):
    """Run n independent one-iteration trials; returns list of emitted-sequence strings."""
    from blockspec.verification import verify

    gen = torch.Generator().manual_seed(seed)
    outcomes = []
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        x = sample_paths(draft, m, k, gamma, gen)
        q = draft.rows(x, range(gamma)).to(dtype)
        p = target.rows(x, range(gamma + 1)).to(dtype)
        out = on_device(verify, method, x, q, p, gen)
        outcomes.extend(sequences(out.tokens, out.num_tokens))
    return outcomes


def on_device(verify, method, x, q, p, gen, **kw):
    """``verify`` on DEVICE; the output's tensors come back to the CPU (a carry stays on DEVICE).

    On the CPU this is a plain call with ``gen``. Elsewhere the verifier gets a generator of
    that device seeded from ``gen`` (62 random bits per call), so runs stay reproducible.
    """
    if DEVICE.type == "cpu":
        return verify(method, x, q, p, generator=gen, **kw)
    seed = int(torch.randint(2**62, (1,), generator=gen))
    dev_gen = torch.Generator(DEVICE).manual_seed(seed)
    out = verify(
        method, x.to(DEVICE), q.to(DEVICE), p.to(DEVICE), generator=dev_gen, graphs=GRAPHS, **kw
    )
    fields = [f.name for f in dataclasses.fields(out) if f.name != "carry"]
    return dataclasses.replace(out, **{name: getattr(out, name).cpu() for name in fields})


def sequences(tokens: torch.Tensor, lengths: torch.Tensor) -> list[str]:
    arr = tokens.numpy()
    return [",".join(map(str, row[:n])) for row, n in zip(arr, lengths.tolist(), strict=True)]


def chi_square(
    observed: Counter, expected_law: dict[str, float], n: int, min_expected: float = 5.0
):
    """Pearson chi-square of observed outcome counts against an exact law.

    Outcomes of probability 0 that occur fail at once (p-value 0). Cells with expected count
    below ``min_expected`` are pooled into one cell. Returns (statistic, dof, p-value).
    """
    impossible = [o for o in observed if expected_law.get(o, 0.0) <= 0]
    if impossible:
        return math.inf, 0, 0.0
    big = {o: pr for o, pr in expected_law.items() if pr * n >= min_expected}
    obs = [observed.get(o, 0) for o in big]
    exp = [pr * n for pr in big.values()]
    rest_exp = n - sum(exp)
    if rest_exp > 1e-9:
        obs.append(n - sum(obs))
        exp.append(rest_exp)
    obs_a, exp_a = np.array(obs, float), np.array(exp, float)
    stat = float(((obs_a - exp_a) ** 2 / exp_a).sum())
    dof = len(obs) - 1
    return stat, dof, float(stats.chi2.sf(stat, dof))


def exact_sequence_law(model: TableModel, length: int) -> dict[str, float]:
    """Law of the first `length` tokens under a table model, by enumeration."""
    law = {}
    for idx in range(model.V**length):
        seq = tuple((idx // model.V ** (length - 1 - i)) % model.V for i in range(length))
        pr = model.prob(seq)
        if pr > 0:
            law[",".join(map(str, seq))] = pr
    return law


# ---------------------------------------------------------------------------------------------
# Outer decode loop over context-dependent models (loop-level losslessness).
# ---------------------------------------------------------------------------------------------


def random_rows(vocab: int, seed: int, scale: float = 1.0):
    """fn(prefix) -> softmax(scale * N(0, 1) logits), seeded by (seed, prefix): any table size."""

    def fn(prefix: tuple[int, ...]) -> list[float]:
        logits = scale * np.random.default_rng([seed, len(prefix), *prefix]).standard_normal(vocab)
        w = np.exp(logits - logits.max())
        return list(w / w.sum())

    return fn


class WindowModel:
    """A model whose conditional after any prefix is the table row of its last ``window`` tokens.

    ``table`` is a :class:`TableModel` with ``max_len >= window``; prefixes shorter than the
    window use their own rows. window = 1 is a Markov chain, window >= the longest prefix ever
    seen is a full-prefix model. Defined for prefixes of any length, so the decode loop never
    runs off the tables.
    """

    def __init__(self, table: TableModel, window: int | None = None):
        self.table = table
        self.window = table.max_len if window is None else window
        self.V = table.V
        assert self.window <= table.max_len

    @staticmethod
    def from_fn(vocab: int, window: int, fn) -> WindowModel:
        return WindowModel(TableModel(vocab, window, fn), window)

    def cond(self, seq: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """seq [..., T] int64, lengths [...] (prefix length per row) -> rows [..., V]."""
        w = self.window
        n = lengths.clamp_max(w)
        start = lengths - n
        idx = torch.zeros_like(lengths)
        T = seq.shape[-1]
        for j in range(w):
            pos = (start + j).clamp(0, T - 1)
            tok = seq.gather(-1, pos.unsqueeze(-1)).squeeze(-1)
            idx = torch.where(j < n, idx * self.V + tok, idx)
        offsets = torch.tensor(self.table.offsets, dtype=torch.int64)
        return self.table.table[idx + offsets[n]]

    def exact_law(self, length: int) -> torch.Tensor:
        """[V^length] float64: P(first `length` tokens = s), s indexed by its base-V code."""
        V = self.V
        codes = torch.arange(V**length)
        seqs = torch.stack([(codes // V ** (length - 1 - i)) % V for i in range(length)], -1)
        prob = torch.ones(V**length, dtype=torch.float64)
        for i in range(length):
            rows = self.cond(seqs, torch.full((V**length,), i, dtype=torch.int64))
            prob = prob * rows.double().gather(-1, seqs[:, i : i + 1]).squeeze(-1)
        return prob


def law_dict(law: torch.Tensor) -> dict[int, float]:
    """Dense law tensor -> {code: probability} (positive cells), the form chi_square takes."""
    nz = torch.nonzero(law > 0).squeeze(-1).tolist()
    return {c: float(law[c]) for c in nz}


def counts_of(codes: torch.Tensor) -> Counter:
    values, counts = np.unique(codes.numpy(), return_counts=True)
    return Counter(dict(zip(values.tolist(), counts.tolist(), strict=True)))


def sequence_codes(seq: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, L] tokens -> [N] base-V codes (first token most significant, as in exact_law)."""
    code = torch.zeros(seq.shape[0], dtype=torch.int64)
    for i in range(seq.shape[1]):
        code = code * vocab + seq[:, i]
    return code


def method_step(method: str, thread_carry: bool = True):
    """A loop step calling ``verify``; thread_carry=False drops the carry (a lossy mutant)."""
    from blockspec.verification import verify

    def step(x, q, p, gen, carry):
        return on_device(verify, method, x, q, p, gen, carry=carry if thread_carry else None)

    return step


def draft_block(
    target: WindowModel,
    draft: WindowModel,
    seq: torch.Tensor,
    count: torch.Tensor,
    k: int,
    gamma: int,
    gen: torch.Generator | list[torch.Generator],
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draft k i.i.d. paths of γ tokens after each row's context and gather the verifier inputs.

    seq [m, W] holds each request's tokens, count [m] how many of them are its context
    (W >= count + γ). ``gen`` is one generator for the batch or one per request (then a
    request's draft does not depend on its batch-mates); with ``uniforms`` [m, k, γ], tokens
    are drawn by inverse CDF with them instead (the engine's counter-based draws). Returns
    x [m, k, γ] int64, q [m, k, γ, V] and p [m, k, γ+1, V] (float64, from the tables).
    """
    m, width = seq.shape
    V = draft.V
    buf = seq[:, None, :].expand(m, k, width).clone()
    start = count[:, None].expand(m, k)
    q_rows = []
    for i in range(gamma):
        q = draft.cond(buf, start + i)  # [m, k, V]
        if uniforms is not None:
            flat = uniforms[:, :, i].reshape(-1)
            tok = sample_from_weights(q.reshape(-1, V).double(), flat).view(m, k)
        elif isinstance(gen, torch.Generator):
            tok = torch.multinomial(q.reshape(-1, V), 1, generator=gen).view(m, k)
        else:
            tok = torch.stack(
                [torch.multinomial(q[j], 1, generator=g)[:, 0] for j, g in enumerate(gen)]
            )
        buf.scatter_(-1, (start + i).unsqueeze(-1), tok.unsqueeze(-1))
        q_rows.append(q)
    x = buf.gather(-1, start.unsqueeze(-1) + torch.arange(gamma))
    p = torch.stack([target.cond(buf, start + i) for i in range(gamma + 1)], dim=2)
    return x, torch.stack(q_rows, dim=2), p


def check_output(out, x: torch.Tensor, vocab: int) -> None:
    """Structural checks of one VerifyOutput against its draft x [m, k, γ].

    1 <= τ+1 <= γ+1; emitted tokens in [0, V) and -1 after them; the accepted prefix is a
    prefix of draft path ``out.path``; a carry holds no NaN.
    """
    m, _, gamma = x.shape
    offs = torch.arange(gamma + 1)
    n = out.num_tokens
    inside = offs[None, :] < n[:, None]
    assert out.tokens.shape == (m, gamma + 1)
    assert bool(((n >= 1) & (n <= gamma + 1)).all()), "num_tokens outside [1, γ+1]"
    assert bool((out.num_accepted == n - 1).all()), "num_accepted != num_tokens - 1"
    assert bool(((out.tokens >= 0) & (out.tokens < vocab))[inside].all()), "bad emitted token"
    assert bool((out.tokens[~inside] == -1).all()), "tokens after the emitted ones must be -1"
    path_tokens = x[torch.arange(m), out.path]  # [m, γ]
    accepted = offs[None, :gamma] < out.num_accepted[:, None]
    assert bool((out.tokens[:, :gamma] == path_tokens)[accepted].all()), "not a draft prefix"
    if out.carry is not None:
        for t in (out.carry.log_p, out.carry.log_q):
            assert not bool(torch.isnan(t).any()), "NaN in the carried modification"


def decode_loop(
    step,
    target: WindowModel,
    draft: WindowModel,
    n: int,
    k: int,
    gamma: int,
    length: int,
    seed: int,
    dtype=torch.float64,
    draft_uniforms=None,
) -> torch.Tensor:
    """Run n independent speculative-decoding trials, batched, until each has >= `length` tokens.

    Each iteration drafts k i.i.d. paths of γ tokens from the draft model given each active
    trial's context (:func:`draft_block`; with ``draft_uniforms``, a function of
    ((trial key, root position) [m, 2], k, γ) as workers.sampling.draft_uniforms, by inverse
    CDF with its uniforms), calls ``step(x, q, p, generator, carry)`` (returns a
    VerifyOutput; see :func:`method_step`), checks the output's structure (:func:`check_output`)
    and appends the emitted tokens. Trials that have `length` tokens leave the batch, and their
    carry rows are dropped with ``TargetModification.select`` (exercised on every iteration).
    Returns [n, length] int64: the first `length` generated tokens of every trial.
    """
    gen = torch.Generator().manual_seed(seed)
    width = length + gamma  # a trial with length-1 tokens ends with at most length+γ
    seq = torch.zeros(n, width + 1, dtype=torch.int64)  # last column: scratch for padding
    count = torch.zeros(n, dtype=torch.int64)
    active = torch.arange(n)
    carry = None
    offs = torch.arange(gamma + 1)
    while active.numel() > 0:
        cnt = count[active]
        rows = seq[active]
        uniforms = None
        if draft_uniforms is not None:  # the root: the last token of the context (-1: none)
            draws = torch.stack([active + seed * n, cnt - 1], dim=1)
            uniforms = draft_uniforms(draws, k, gamma)
        x, q, p = draft_block(target, draft, rows, cnt, k, gamma, gen, uniforms)
        out = step(x, q.to(dtype), p.to(dtype), gen, carry)
        check_output(out, x, target.V)
        inside = offs[None, :] < out.num_tokens[:, None]
        rows.scatter_(1, torch.where(inside, cnt[:, None] + offs, width), out.tokens.clamp_min(0))
        seq[active] = rows
        count[active] = cnt + out.num_tokens
        still = torch.nonzero(count[active] < length).squeeze(-1)
        carry = out.carry.select(still) if out.carry is not None else None
        active = active[still]
    return seq[:, :length]


def loop_law_pvalue(seq: torch.Tensor, target: WindowModel) -> float:
    """Chi-square p-value of the law of the generated sequences [N, L] vs the target's exact law."""
    n, length = seq.shape
    law = law_dict(target.exact_law(length))
    return chi_square(counts_of(sequence_codes(seq, target.V)), law, n)[2]


@cache
def reference_models(instance: str) -> tuple[TableModel, TableModel, int]:
    """(target, draft, γ) table models of a reference instance of spec §12."""
    spec = load_reference()[0][instance]
    gamma, vocab = spec["gamma"], len(spec["target"][""])
    target = TableModel.from_json(spec["target"], vocab, gamma)
    draft = TableModel.from_json(spec["draft"], vocab, gamma)
    return target, draft, gamma
