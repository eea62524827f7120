"""`blockspec` command line.

Until the serving stack lands, the CLI exposes the verification library: `methods` lists the
verifiers and `demo` runs each of them on the spec's toy instance, printing the measured
expected accepted tokens next to the exact values of spec §12.
"""

from __future__ import annotations

import argparse
import time
from fractions import Fraction

import torch
from rich.console import Console
from rich.table import Table

from service.verification import VERIFIERS, verify

# Spec §12, toy instance (γ = 2, V = 2, context independent): exact E[τ] per method and K.
TOY_TARGET = (1 / 3, 2 / 3)
TOY_DRAFT = (2 / 3, 1 / 3)
TOY_EXACT = {
    "token": {1: "10/9"},
    "block": {1: "11/9"},
    "greedy_block": {1: "12/9"},
    "naive": {1: "52/81", 2: "82/81", 3: "8200/6561"},
    "specinfer": {1: "10/9", 2: "4/3", 3: "1087/729"},
    "spectr": {1: "10/9", 2: "1.405487", 3: "1.593306"},
    "gbv": {1: "11/9", 2: "131/81", 3: "1289/729"},
    "traversal": {1: "11/9", 2: "115/81", 3: "1136/729"},
    "spectr_gbv": {1: "4/3", 2: "40/27", 3: "386/243"},
}


def _exact(text: str) -> float:
    return float(Fraction(text)) if "/" in text else float(text)


def demo(trials: int, seed: int) -> None:
    console = Console()
    gamma, gen = 2, torch.Generator().manual_seed(seed)
    table = Table(title=f"toy instance (spec §12), γ = {gamma}, {trials:,} trials per cell")
    for col in ("method", "K", "E[τ] measured", "E[τ] exact", "ms per call"):
        table.add_column(col, justify="right" if col != "method" else "left")
    for method, exact in TOY_EXACT.items():
        for k, value in exact.items():
            q = torch.tensor(TOY_DRAFT).expand(trials, k, gamma, 2)
            p = torch.tensor(TOY_TARGET).expand(trials, k, gamma + 1, 2)
            x = torch.multinomial(q.reshape(-1, 2), 1, generator=gen).view(trials, k, gamma)
            start = time.perf_counter()
            out = verify(method, x, q, p, generator=gen)
            ms = (time.perf_counter() - start) * 1e3
            measured = out.num_accepted.double().mean().item()
            table.add_row(
                method, str(k), f"{measured:.4f}", f"{_exact(value):.4f} ({value})", f"{ms:.1f}"
            )
    console.print(table)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="blockspec", description="Lossless speculative decoding")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("methods", help="list the verification methods")
    d = sub.add_parser("demo", help="run every verifier on the spec's toy instance")
    d.add_argument("--trials", type=int, default=200_000)
    d.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.command == "methods":
        for v in VERIFIERS.values():
            paths = "K = 1" if v.single_path else "K >= 1"
            print(f"{v.name:13s} {paths:7s} {v.description}")
    else:
        demo(args.trials, args.seed)


if __name__ == "__main__":
    main()
