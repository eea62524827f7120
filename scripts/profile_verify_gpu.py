"""One verify call per method on CUDA, replayed from its graph: median ms, GPU busy ms, and
the kernels that took the GPU time, plus the seeded output (to compare two revisions).

    PYTHONPATH=. python3 scripts/profile_verify_gpu.py [--methods naive specinfer ...]
        [--batch 32] [--k 4] [--gamma 8] [--vocab 32000] [--top 12] [--json out.json]

An A/B against another revision: `git worktree add /tmp/base REV`, then run this script once
with PYTHONPATH=/tmp/base and once with PYTHONPATH=., alternating, and compare the JSONs'
`tokens`, `num_tokens` and `path` (the A/B table of docs/verification_benchmark.md came from
this script).
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import torch
from bench_verify import make_inputs, median_ms, profile_call

from blockspec.verification import VerifyGraphs, verify


def gpu_profile(fn, top: int) -> dict:
    """bench_verify.profile_call of fn after a warm-up call."""
    fn()
    torch.cuda.synchronize()
    return profile_call(fn, top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--methods",
        nargs="+",
        default=["naive", "specinfer", "spectr", "gbv", "traversal", "spectr_gbv"],
    )
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--gamma", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--top", type=int, default=12, help="kernels printed per method")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("graph replays and GPU busy time are CUDA measurements: no CUDA device here")
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    print("#", out["gpu"], out["torch"], flush=True)
    x, q, p = make_inputs(args.batch, args.k, args.gamma, args.vocab, "cuda")
    for method in args.methods:
        graphs, gen = VerifyGraphs(), torch.Generator("cuda").manual_seed(1)
        replay = functools.partial(verify, method, x, q, p, gen, validate=False, graphs=graphs)
        start = time.perf_counter()
        replay()  # the capture
        capture_s = time.perf_counter() - start
        ms = median_ms(replay, 31, "cuda")
        replayed = gpu_profile(replay, args.top)
        eager = gpu_profile(
            functools.partial(verify, method, x, q, p, gen, validate=False), args.top
        )
        seeded = [
            verify(method, x, q, p, torch.Generator("cuda").manual_seed(2), validate=False, **kw)
            for kw in ({}, {"graphs": graphs})
        ]
        fields = ("tokens", "num_tokens", "path")
        same = all(torch.equal(getattr(seeded[0], f), getattr(seeded[1], f)) for f in fields)
        out[method] = dict(
            replay_ms=ms,
            capture_s=capture_s,
            replay_prof=replayed,
            eager_prof=eager,
            graph_same=same,
            **{f: getattr(seeded[0], f).tolist() for f in fields},
        )
        print(
            f"\n## {method}: replay {ms:.3f} ms, replay busy {replayed['gpu_ms']:.3f} "
            f"({replayed['kernels']} kernels), graph same {same}; eager busy "
            f"{eager['gpu_ms']:.3f} ({eager['kernels']}, {eager['waits']} host waits)",
            flush=True,
        )
        for kernel in replayed["top_kernels"]:
            print(f"  {kernel['ms']:7.4f} ms {kernel['calls']:4d}x  {kernel['name']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
