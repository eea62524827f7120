"""Check a tensor-parallel target against the unsharded one on a local checkpoint.

Prefills the same random prompts into both, then scores random draft trees step by step
(committing a random accepted prefix each step, so the sharded KV caches are exercised) and
prints the max |Δlogit| over all real tree nodes and the per-step time of 1 rank vs N ranks.
Also lists the TCP listeners of every rank (they must all be on loopback).

    .venv/bin/python scripts/check_tp.py                       # models/tiny/target, 2 ranks
    .venv/bin/python scripts/check_tp.py --target DIR --world 2 --steps 20

Exit status 1 if the difference exceeds --tol or a listener is not on loopback.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch

from workers.models import DTYPES, load_model
from workers.target import TargetWorker
from workers.tensor_parallel import TensorParallelTarget
from workers.tree import build_tree

LOOPBACK = ("127.0.0.1:", "[::1]:", "[::ffff:127.0.0.1]:")


def listeners(pids: list[int]) -> list[str]:
    """`ss -ltnp` lines (state LISTEN, TCP) owned by any of pids."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if any(f"pid={p}," in line for p in pids)]


def random_tree(n: int, k: int, gamma: int, vocab: int, g: torch.Generator):
    """Trees of K paths of depth γ per request that share their first token (a real tree)."""
    paths = torch.randint(0, vocab, (n, k, gamma), generator=g)  # [n, K, γ]
    paths[:, 1:, 0] = paths[:, :1, 0]
    full = torch.full((n,), k), torch.full((n,), gamma)
    return build_tree(torch.randint(0, vocab, (n,), generator=g), paths, *full)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="models/tiny/target", help="local HF checkpoint directory")
    ap.add_argument("--world", type=int, default=2, help="tensor-parallel ranks")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--batch", type=int, default=4, help="requests per step")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--k", type=int, default=2, help="draft paths per request")
    ap.add_argument("--gamma", type=int, default=4, help="draft depth")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads of every rank")
    ap.add_argument("--tol", type=float, default=1e-4, help="max |Δlogit| allowed")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    max_len = args.prompt_len + args.steps * (args.gamma + 1) + 1
    loaded = load_model(args.target, args.dtype)
    spec = loaded.spec
    print(
        f"{args.target}: {spec.num_layers} layers, hidden {spec.hidden_size}, heads "
        f"{spec.num_heads}/{spec.num_kv_heads} kv, MLP {spec.intermediate_size}, "
        f"vocab {spec.vocab_size}; {args.dtype}, {args.threads} thread(s) per rank"
    )
    ref = TargetWorker(loaded.build(), args.batch, max_len, DTYPES[args.dtype])
    t0 = time.perf_counter()
    tp = TensorParallelTarget(
        args.target, args.world, args.batch, max_len, args.dtype, num_threads=args.threads
    )
    ok = True
    with tp:
        print(f"{args.world} ranks up in {time.perf_counter() - t0:.1f} s")
        if shutil.which("ss"):
            lines = listeners([os.getpid(), *tp.worker_pids])
            exposed = [ln for ln in lines if not ln.split()[3].startswith(LOOPBACK)]
            print(f"listeners of the group ({len(lines)}), non-loopback: {len(exposed)}")
            for line in lines:
                print("  " + " ".join(line.split()))
            ok &= not exposed
        else:
            print("ss not found: listener check skipped")

        g = torch.Generator().manual_seed(args.seed)
        prompts = [
            torch.randint(0, spec.vocab_size, (args.prompt_len,), generator=g)
            for _ in range(args.batch)
        ]
        times: dict[str, list[float]] = {"1 rank": [], f"{args.world} ranks": []}
        prefill = {}
        for name, target in zip(times, (ref, tp), strict=True):
            t = time.perf_counter()
            target.prefill(0, prompts)
            prefill[name] = time.perf_counter() - t
        worst = 0.0
        for step in range(args.steps + 1):  # step 0 warms up, untimed
            tree = random_tree(args.batch, args.k, args.gamma, spec.vocab_size, g)
            logits = []
            for name, target in zip(times, (ref, tp), strict=True):
                t = time.perf_counter()
                logits.append(target.score_logits(tree))  # [n, N, V]
                if step:
                    times[name].append(time.perf_counter() - t)
            worst = max(worst, (logits[0] - logits[1]).abs().max().item())
            path = torch.randint(0, args.k, (args.batch,), generator=g)
            accepted = torch.randint(0, args.gamma + 1, (args.batch,), generator=g)
            ref.commit(path, accepted)
            tp.commit(path, accepted)
        ok &= bool(torch.equal(ref.cache.lengths, tp.cache.lengths))

    nodes = 1 + args.k * args.gamma - (args.k - 1)
    print(
        f"\nmax |Δlogit| over {args.steps + 1} scored steps after a prefill "
        f"({args.batch} requests x {nodes} tree nodes): {worst:.3g} (tol {args.tol:g})"
    )
    print(f"{'':>10}  prefill ({args.batch}x{args.prompt_len})   score step: median    mean")
    for name, ts in times.items():
        print(
            f"{name:>10}  {prefill[name] * 1e3:12.1f} ms {'':9}"
            f"{statistics.median(ts) * 1e3:8.2f} ms {statistics.mean(ts) * 1e3:6.2f} ms"
        )
    ok &= worst <= args.tol
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
