"""oneDNN-packed weights against F.linear on dense ones, side by side in one process (float32).

    .venv/bin/python scripts/bench_forward.py [--threads 1 2] [--new 1 5] [--batch 1 8] \\
        [--prompts 6] [--new-tokens 64] [--repeats 2] [--e2e-threads 1]

Builds each model of the pair twice from the same loaded weights, as served by default
("packed": every weight that workers.llama.packs_weights picks, all of the default pair's) and
plain (`packed=False`: F.linear on dense weights), then:
1. forwards: for every thread count × batch × new-token count, the target's and the draft's
   median forward (200-token cache), the two layouts alternating cell by cell;
2. end to end (unless `--prompts 0`): the in-process engine at batch 1, `none` and `block`
   (γ = 4, T = 1, seeded, `--new-tokens` per HumanEval prompt), each layout `--repeats` times,
   alternating; tokens/s medians, each layout's `block` over its own `none`.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from bench_engine import forward_ms, run_engine

from loadtest.prompts import prompt_ids
from service.engine import build_engine
from workers.models import DEFAULT_DRAFT, DEFAULT_TARGET, load_model

LAYOUTS = {"packed": None, "plain": False}  # name: Llama's `packed` argument


def forwards(args) -> None:
    models = {}
    for role, path in (("target", args.target), ("draft", args.draft)):
        loaded = load_model(path, "float32")
        models[role] = {name: loaded.build(packed=p) for name, p in LAYOUTS.items()}
    print("| threads | batch | new | target packed | target plain | × | draft packed "
          "| draft plain | × |")  # fmt: skip
    print("|" + "---|" * 9)
    one = {}  # (threads, batch, layout) -> the target's one-token forward
    for threads in args.threads:
        torch.set_num_threads(threads)
        for batch in args.batch:
            for new in args.new:
                ms = {
                    (role, p): forward_ms(models[role][p], new, batch=batch, repeats=args.calls)
                    for role in ("target", "draft")
                    for p in LAYOUTS
                }
                cells = []
                for role in ("target", "draft"):
                    packed, plain = ms[role, "packed"], ms[role, "plain"]
                    cells += [f"{packed:.1f}", f"{plain:.1f}", f"{plain / packed:.2f}"]
                print(f"| {threads} | {batch} | {new} | " + " | ".join(cells) + " |", flush=True)
                for p in LAYOUTS:
                    if new == 1:
                        one[threads, batch, p] = ms["target", p]
                    elif (threads, batch, p) in one:
                        ratio = ms["target", p] / one[threads, batch, p]
                        print(f"    target, {new} tokens, {p}: {ratio:.2f}× one token")


def end_to_end(args) -> None:
    torch.set_num_threads(args.e2e_threads)
    engines = {}
    for name, p in LAYOUTS.items():
        engines[name], tokenizer = build_engine(args.draft, args.target, 1, packed=p)
    prompts = prompt_ids(tokenizer, "humaneval", args.prompts, 1024 - args.new_tokens - 6)
    configs = {"none": ("none", 1, 1), "block": ("block", 1, 4)}
    for engine in engines.values():  # warm-up, discarded
        for method, k, gamma in configs.values():
            run_engine(engine, prompts[:1], method, k, gamma, 1.0, 16)
    runs: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.repeats):
        for p in LAYOUTS:
            for label, (method, k, gamma) in configs.items():
                res = run_engine(engines[p], prompts, method, k, gamma, 1.0, args.new_tokens)
                runs.setdefault((p, label), []).append(res)
                print(f"  {p} {label}: {res['tokens_per_s']:.2f} tok/s, "
                      f"BE {res['block_efficiency']:.2f}", flush=True)  # fmt: skip
    print(f"\n| layout | none tok/s | block tok/s | block BE | block × its none "
          f"(batch 1, {args.e2e_threads} thread(s), median of {args.repeats}) |")  # fmt: skip
    print("|---|---|---|---|---|")
    for p in LAYOUTS:
        tps = {c: statistics.median(r["tokens_per_s"] for r in runs[p, c]) for c in configs}
        be = statistics.median(r["block_efficiency"] for r in runs[p, "block"])
        print(f"| {p} | {tps['none']:.2f} | {tps['block']:.2f} | {be:.2f} | "
              f"{tps['block'] / tps['none']:.2f} |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(DEFAULT_TARGET))
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--calls", type=int, default=15, help="forwards per cell (median)")
    ap.add_argument("--prompts", type=int, default=6, help="end to end; 0 skips it")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--e2e-threads", type=int, default=1)
    args = ap.parse_args()
    print(f"python scripts/bench_forward.py {' '.join(sys.argv[1:])}; torch {torch.__version__}")
    forwards(args)
    if args.prompts:
        end_to_end(args)


if __name__ == "__main__":
    main()
