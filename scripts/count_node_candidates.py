"""How many of the rows a top-down node rule sees have one candidate, on bench_verify's inputs.

SpecTr's and SpecInfer's CUDA kernels read no row of a node that one candidate passes
through (ρ* = 1; one level): every node below where the paths part, and a finished request's.
This counts those rows on the fixed-shape path a GPU runs (the torch ops, on the CPU), for
the inputs `scripts/bench_verify.py` times (docs/verification_benchmark.md).

    .venv/bin/python scripts/count_node_candidates.py [--batch 32] [--k 4] [--gamma 8]
        [--vocab 49152] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench_verify import make_inputs  # noqa: E402

from blockspec.verification import top_down, verify  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--gamma", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_args()

    counts: list[torch.Tensor] = []  # [B] candidates at each node, one entry per rule call
    rule = top_down.spectr_rule

    def counting_rule(backend, p_row, q_row, cand, is_cand, u):
        counts.append(is_cand.sum(-1))
        return rule(backend, p_row, q_row, cand, is_cand, u)

    top_down.spectr_rule = counting_rule
    shape = (args.batch, args.k, args.gamma, args.vocab)
    for seed in args.seeds:
        x, q, p = make_inputs(*shape, "cpu", seed)
        counts.clear()
        gen = torch.Generator().manual_seed(seed)
        verify("spectr", x, q, p, gen, validate=False, backend="torch-device")
        n = torch.stack(counts)  # [calls, B]
        several = int((n > 1).sum())
        print(
            f"seed {seed}: {n.numel()} rows in {n.shape[0]} node-rule calls, {several} with "
            f"several candidates, {1 - several / n.numel():.1%} with one; by call: "
            f"{(n > 1).sum(-1).tolist()}"
        )


if __name__ == "__main__":
    main()
