"""SpecTr's CUDA kernel settings side by side: one `spectr` call replayed from a CUDA graph
for each (columns a step, warps, programs a multiprocessor) of verification/top_down/kernels.py.

    python3 scripts/bench_kseq_knobs.py [--batch 32] [--k 4] [--gamma 8] [--vocab 32000 49152]
        [--settings 128/4/2 128/4/4 64/2/4 128/2/8 64/2/8 256/4/4] [--repeats 21]

Prints, per vocabulary and setting, the median replay ms, the GPU busy ms of one replay, and
whether its tokens equal the default setting's eager call's (the settings split rows
differently, so the sums may round apart; the tokens should not move). The defaults
(KSEQ_BLOCK, KSEQ_WARPS, KSEQ_PROGRAMS_PER_SM) come from this script on an H100 (the sweep is in
the git history of docs/verification_benchmark.md, commit 7aa8946).
"""

from __future__ import annotations

import argparse
import functools

import torch
from bench_verify import make_inputs, median_ms, profile_call

from blockspec.verification import VerifyGraphs, verify
from blockspec.verification.top_down import kernels as knobs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--gamma", type=int, default=8)
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 49152])
    ap.add_argument(
        "--settings",
        nargs="+",
        default=["128/4/2", "128/4/4", "64/2/4", "128/2/8", "64/2/8", "256/4/4"],
    )
    ap.add_argument("--repeats", type=int, default=21)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("the kernels' settings are CUDA measurements: no CUDA device here")
    print(f"# spectr, B={args.batch} K={args.k} γ={args.gamma}, {torch.cuda.get_device_name()}")
    print("| V | columns/warps/programs a SM | replay ms | GPU busy ms | same tokens |")
    print("|---|---|---|---|---|")
    defaults = (
        knobs.KSEQ_BLOCK,
        knobs.KSEQ_WARPS,
        knobs.KSEQ_PROGRAMS_PER_SM,
    )
    for vocab in args.vocab:
        x, q, p = make_inputs(args.batch, args.k, args.gamma, vocab, "cuda")
        (
            knobs.KSEQ_BLOCK,
            knobs.KSEQ_WARPS,
            knobs.KSEQ_PROGRAMS_PER_SM,
        ) = defaults
        want = verify("spectr", x, q, p, torch.Generator("cuda").manual_seed(2))
        for setting in args.settings:
            block, warps, per_sm = map(int, setting.split("/"))
            (
                knobs.KSEQ_BLOCK,
                knobs.KSEQ_WARPS,
                knobs.KSEQ_PROGRAMS_PER_SM,
            ) = (
                block,
                warps,
                per_sm,
            )
            graphs = VerifyGraphs()  # a fresh capture with these settings
            gen = torch.Generator("cuda").manual_seed(1)
            replay = functools.partial(
                verify, "spectr", x, q, p, gen, validate=False, graphs=graphs
            )
            replay()  # the capture
            busy = profile_call(replay)["gpu_ms"]
            ms = median_ms(replay, args.repeats, "cuda")
            got = verify("spectr", x, q, p, torch.Generator("cuda").manual_seed(2), graphs=graphs)
            same = all(torch.equal(getattr(got, f), getattr(want, f)) for f in ("tokens", "path"))
            print(f"| {vocab} | {setting} | {ms:.2f} | {busy:.2f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
