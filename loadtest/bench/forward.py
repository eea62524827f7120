"""Weight layouts side by side in one process: oneDNN-packed against F.linear on dense weights,
in float32 and bfloat16, and weight-only int8.

    blockspec-bench forward [--layouts f32-packed f32-plain] \\
        [--threads 1 2] [--new 1 5] [--batch 1 8] [--prompts 6] [--new-tokens 64] \\
        [--repeats 2] [--e2e-threads 1]

A layout is a dtype and a packing: `f32-packed` and `bf16-packed` (every weight that
workers.llama.packs_weights would pick on a CPU that packs that dtype; bfloat16 is packed by
default only where the CPU has AVX-512 BF16 or AMX), `f32-plain` and `bf16-plain` (F.linear on
dense weights), `int8` (`--dtype int8`: every projection and the head weight-only int8,
bfloat16 activations), and `f32-compiled` and `bf16-compiled` (a dense layout's forward through
workers.compiled.compile_forward, as the engine's `compiled` forwards; forwards only, the first
call of each shape compiles, about a minute for the target). Each model of the pair is built once
per layout, then:
1. forwards: for every thread count × batch × new-token count, the target's and the draft's
   median forward (200-token cache), the layouts alternating cell by cell, each against the
   first layout;
2. end to end (unless `--prompts 0`): the in-process engine at batch 1, `none` and `block`
   (γ = 4, T = 1, seeded, `--new-tokens` per HumanEval prompt), each layout `--repeats` times,
   alternating; tokens/s medians, each layout's `block` over its own `none`.
"""

from __future__ import annotations

import statistics

import torch

from blockspec.loadtest.bench.engine import forward_ms, run_engine
from blockspec.loadtest.bench.harness import alternate, command, machine, parser
from blockspec.loadtest.prompts import prompt_ids
from blockspec.service.build import build_engine
from blockspec.workers.compiled import compile_forward
from blockspec.workers.graphs import prefix_window
from blockspec.workers.models import DEFAULT_DRAFT, DEFAULT_TARGET, load_model

# name: (dtype, Llama's `packed` argument: None packs what packs_weights picks)
LAYOUTS = {
    "f32-packed": ("float32", None),
    "f32-plain": ("float32", False),
    "bf16-packed": ("bfloat16", None),
    "bf16-plain": ("bfloat16", False),
    "int8": ("int8", None),  # weight-only int8 projections and head (workers.llama.Int8Linear)
}
# The dense layouts' forward through workers.compiled.compile_forward (inductor's C++ backend
# with freezing: inductor packs the weights itself), reading the bucketed prefix window the
# engine's compiled forwards read. Forwards only here (the engine's: blockspec-bench llamacpp).
COMPILED = {"f32-compiled": "f32-plain", "bf16-compiled": "bf16-plain"}


def windowed(forward):
    """forward(tokens, positions, cache, mask, ...) reading the engine's prefix window."""

    def call(tokens, positions, cache, mask, *args, **kwargs):
        window = prefix_window(cache, tokens.shape[0])
        return forward(tokens, positions, cache, mask, *args, **kwargs, window=window)

    return call


def forwards(args) -> None:
    models = {}
    for role, path in (("target", args.target), ("draft", args.draft)):
        dtypes = {LAYOUTS[COMPILED.get(n, n)][0] for n in args.layouts}
        loaded = {dtype: load_model(path, dtype) for dtype in dtypes}
        for name in args.layouts:
            dtype, packed = LAYOUTS[COMPILED.get(name, name)]
            models[role, name] = model = loaded[dtype].build(packed=packed)
            if name in COMPILED:
                model.forward = windowed(compile_forward(model))
    first, *others = args.layouts
    head = ["threads", "batch", "new"]
    for role in ("target", "draft"):
        head += [f"{role} {name} ms" for name in args.layouts]
        head += [f"{role} {first} / {name}" for name in others]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    one = {}  # (threads, batch, layout) -> the target's one-token forward
    for threads in args.threads:
        torch.set_num_threads(threads)
        for batch in args.batch:
            for new in args.new:
                ms = {
                    (role, name): forward_ms(models[role, name], new, batch=batch,
                                             repeats=args.calls)
                    for role in ("target", "draft")
                    for name in args.layouts
                }  # fmt: skip
                cells = [str(threads), str(batch), str(new)]
                for role in ("target", "draft"):
                    cells += [f"{ms[role, name]:.1f}" for name in args.layouts]
                    cells += [f"{ms[role, first] / ms[role, name]:.2f}" for name in others]
                print("| " + " | ".join(cells) + " |", flush=True)
                for name in args.layouts:
                    if new == 1:
                        one[threads, batch, name] = ms["target", name]
                    elif (threads, batch, name) in one:
                        ratio = ms["target", name] / one[threads, batch, name]
                        print(f"    target, {new} tokens, {name}: {ratio:.2f}× one token")


def end_to_end(args) -> None:
    torch.set_num_threads(args.e2e_threads)
    engines = {}
    for name in [n for n in args.layouts if n not in COMPILED]:
        dtype, packed = LAYOUTS[name]
        engines[name], tokenizer = build_engine(
            args.draft, args.target, 1, dtype=dtype, packed=packed
        )
    prompts = prompt_ids(tokenizer, "humaneval", args.prompts, 1024 - args.new_tokens - 6)
    configs = {"none": ("none", 1, 1), "block": ("block", 1, 4)}
    for engine in engines.values():  # warm-up, discarded
        for method, k, gamma in configs.values():
            run_engine(engine, prompts[:1], method, k, gamma, 1.0, 16)
    arms = {
        (name, label): lambda e=engine, c=config: run_engine(e, prompts, *c, 1.0, args.new_tokens)
        for name, engine in engines.items()
        for label, config in configs.items()
    }

    def show(arm, _round, res) -> None:
        print(f"  {' '.join(arm)}: {res['tokens_per_s']:.2f} tok/s, "
              f"BE {res['block_efficiency']:.2f}", flush=True)  # fmt: skip

    runs = alternate(arms, args.repeats, warm=False, on_run=show)
    print(f"\n| layout | none tok/s | block tok/s | block BE | block × its none "
          f"(batch 1, {args.e2e_threads} thread(s), median of {args.repeats}) |")  # fmt: skip
    print("|---|---|---|---|---|")
    for name in engines:
        tps = {c: statistics.median(r["tokens_per_s"] for r in runs[name, c]) for c in configs}
        be = statistics.median(r["block_efficiency"] for r in runs[name, "block"])
        print(f"| {name} | {tps['none']:.2f} | {tps['block']:.2f} | {be:.2f} | "
              f"{tps['block'] / tps['none']:.2f} |")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = parser("forward", __doc__)
    ap.add_argument("--target", default=str(DEFAULT_TARGET))
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    layouts = [*LAYOUTS, *COMPILED]
    ap.add_argument("--layouts", nargs="+", choices=layouts, default=layouts[:2])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--calls", type=int, default=15, help="forwards per cell (median)")
    ap.add_argument("--prompts", type=int, default=6, help="end to end; 0 skips it")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--e2e-threads", type=int, default=1)
    args = ap.parse_args(argv)
    print(f"{command('forward', argv)}; {machine()}")
    forwards(args)
    if args.prompts:
        end_to_end(args)
