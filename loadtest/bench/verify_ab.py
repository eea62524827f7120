"""verify() of this checkout against a baseline revision's, alternating in one process.

    blockspec-bench verify-ab --baseline HEAD~1 --methods gbv spectr \\
        --shapes 8x2x49152 1x2x32000 [--gamma 8] [--support 8192] [--carry-steps 3] \\
        [--rounds 5] [--calls 7] [--threads 2]

Checks `--baseline` out into a temporary git worktree and imports its `blockspec` (through a
folder that links to the worktree's folders: harness.package_view) next to this checkout's.
Each cell (method, B x K x V) times one `verify` call on the same inputs for both revisions
(`verify.make_inputs`; with `--support S` every draft row is zero outside one random S of
the V tokens, as a reduced draft head makes them; with `--carry-steps N` greedy methods carry
the modification of N earlier calls, as the engine's steady state does), alternating revisions
round by round so that this VM's drift falls on both. Prints the median over rounds of each
round's median call, every round, the ratio, whether the two revisions' seeded outputs (tokens,
path, a greedy method's carried windows) are identical, and the largest difference between
their carried log-joints: a check of the output, not of every intermediate value.
"""

from __future__ import annotations

import importlib
import statistics
import sys
import time
from pathlib import Path

import torch

from blockspec.loadtest.bench.harness import REPO, alternate, package_view, parser, worktree
from blockspec.loadtest.bench.verify import make_inputs


def load_verification(root: Path):
    """`blockspec.verification` as it is under `root` (its own `workers` too)."""
    for name in [n for n in sys.modules if n.split(".")[0] == "blockspec"]:
        del sys.modules[name]
    view = str(package_view(root))
    sys.path.insert(0, view)
    try:
        return importlib.import_module("blockspec.verification")
    finally:
        sys.path.remove(view)


def inputs(b: int, k: int, gamma: int, vocab: int, support: int | None):
    tokens, q, p = make_inputs(b, k, gamma, vocab, "cpu")
    if support is not None:
        keep = torch.randperm(vocab, generator=torch.Generator().manual_seed(1))[:support]
        off = torch.ones(vocab, dtype=torch.bool)
        off[keep] = False
        q = q.masked_fill(off, 0.0)
        q = q / q.sum(-1, keepdim=True)
        tokens = torch.multinomial(q.view(-1, vocab), 1, generator=torch.Generator().manual_seed(2))
        tokens = tokens.view(b, k, gamma)
    return tokens, q, p


def main(argv: list[str] | None = None) -> None:
    ap = parser("verify-ab", __doc__)
    ap.add_argument("--baseline", default="HEAD~1", help="git revision to compare against")
    ap.add_argument("--methods", nargs="+", default=["token", "gbv"])
    ap.add_argument("--shapes", nargs="+", default=["8x2x49152"], help="BxKxV")
    ap.add_argument("--gamma", type=int, default=8)
    ap.add_argument("--support", type=int, default=None, help="draft support size (default: V)")
    ap.add_argument("--carry-steps", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    with worktree(args.baseline) as base:
        revisions = {"baseline": load_verification(base), "now": load_verification(REPO)}
        run(revisions, args)


def run(revisions: dict, args) -> None:
    cells = []
    for shape in args.shapes:
        b, k, vocab = (int(x) for x in shape.split("x"))
        data = inputs(b, k, args.gamma, vocab, args.support)
        for method in args.methods:
            if revisions["now"].VERIFIERS[method].single_path and k != 1:
                continue
            cells.append((method, b, k, vocab, data))

    def call(verification, method, data):
        gen = torch.Generator().manual_seed(0)
        carry = None
        for _ in range(args.carry_steps if verification.VERIFIERS[method].modifies_target else 0):
            out = verification.verify(method, *data, generator=gen, carry=carry, validate=False)
            carry = out.carry
        start = time.perf_counter()
        out = verification.verify(method, *data, generator=gen, carry=carry, validate=False)
        return time.perf_counter() - start, out

    def one_round(verification) -> list[tuple[float, tuple]]:
        """Every cell's median call (ms) and its output."""
        row = []
        for method, _, _, _, data in cells:
            call(verification, method, data)  # warm-up
            timed = [call(verification, method, data) for _ in range(args.calls)]
            out = timed[-1][1]
            carry = () if out.carry is None else (out.carry.rows_left, out.carry.log_p)
            ms = statistics.median(1e3 * seconds for seconds, _ in timed)
            row.append((ms, (out.tokens, out.path, *carry)))
        return row

    runs = alternate(
        {name: lambda v=v: one_round(v) for name, v in revisions.items()}, args.rounds, warm=False
    )
    rounds = {(i, n): [r[i][0] for r in rs] for n, rs in runs.items() for i in range(len(cells))}
    outputs = {(i, n): rs[-1][i][1] for n, rs in runs.items() for i in range(len(cells))}
    print(
        f"# baseline {args.baseline}; γ={args.gamma}, support={args.support or 'V'}, "
        f"carry steps={args.carry_steps}, {args.threads} thread(s), torch {torch.__version__}"
    )
    print(
        "| method | B | K | V | baseline ms | now ms | now / baseline | same output | "
        "carried log P: largest difference | rounds |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for i, (method, b, k, vocab, _) in enumerate(cells):
        before, after = (statistics.median(rounds[(i, n)]) for n in ("baseline", "now"))
        (*exact, log_p), (*exact_now, log_p_now) = (outputs[(i, n)] for n in ("baseline", "now"))
        same = all(torch.equal(x, y) for x, y in zip(exact, exact_now, strict=True))
        gap = "–" if len(exact) < 3 else f"{largest_difference(log_p, log_p_now):.1e}"
        each = " / ".join(
            ", ".join(f"{t:.1f}" for t in rounds[(i, n)]) for n in ("baseline", "now")
        )
        print(f"| {method} | {b} | {k} | {vocab} | {before:.2f} | {after:.2f} | "
              f"{after / before:.2f} | {same} | {gap} | {each} |")  # fmt: skip


def largest_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over entries finite in both; inf where their shapes or infinities differ.
    The carried log-joints are float64 sums of logs of float32 rows' masses, which the CPU
    loops sum in their own order: they may differ from the torch ops' in the last float32
    bits, the tokens may not."""
    if a.shape != b.shape or not torch.equal(a.isfinite(), b.isfinite()):
        return float("inf")
    finite = a.isfinite()
    return float((a[finite] - b[finite]).abs().max()) if bool(finite.any()) else 0.0
