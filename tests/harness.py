"""Test harness: explicit conditional-table models, batched drafting, exact laws, chi-square.

A *table model* maps every prefix (tuple of token ids, relative to the context) to a
distribution over V tokens. Drafting, row gathering and verification all run batched: one
batch element per independent trial.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from scipy import stats

SPEC_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "spec" / "reference"

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

# Significance level of every law test. The tests are seeded (deterministic), so a pass is
# reproducible; the level keeps the family of ~150 law tests from failing by chance when a
# seed changes (expected false alarms per full run ~0.015).
ALPHA = 1e-4


def load_reference():
    instances = json.loads((SPEC_DIR / "reference_instances.json").read_text())
    numbers = json.loads((SPEC_DIR / "reference_numbers.json").read_text())
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
    from service.verification import verify

    gen = torch.Generator().manual_seed(seed)
    outcomes = []
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        x = sample_paths(draft, m, k, gamma, gen)
        q = draft.rows(x, range(gamma)).to(dtype)
        p = target.rows(x, range(gamma + 1)).to(dtype)
        out = verify(method, x, q, p, generator=gen)
        outcomes.extend(sequences(out.tokens, out.num_tokens))
    return outcomes


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
