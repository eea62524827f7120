"""Two CPU decode-step changes against the code they replaced, alternated in one process.

    .venv/bin/python scripts/ab_cpu_step.py proposal [--threads 1] [--rounds 4]
    .venv/bin/python scripts/ab_cpu_step.py attention [--threads 1] [--rounds 3] [--compiled]
    .venv/bin/python scripts/ab_cpu_step.py gemm [--threads 2] [--rounds 3]
    .venv/bin/python scripts/ab_cpu_step.py guards [--threads 2] [--rounds 3]

- `proposal`: the draft's phase of a step with its proposal compiled as one call
  (workers/compiled.CompiledCalls) against a compiled forward a depth (`draft.proposals` set
  to None, the code before). The default pair in bfloat16, `gbv` K = 2, γ = 4, 4 HumanEval
  prompts × 32 tokens; the target runs eagerly so that only the draft's phase is compared.
- `attention`: the default target's forward with joined keys (workers/llama.py,
  `_joined_tree_attention`) against four products a layer (the SeenKeys' joined mask
  dropped): one token and 9 after 200 cached, and batch 8 × 5 after 1,000 (eager only).
- `gemm`: the default target's compiled forward with inductor's options (workers/compiled.py,
  `INDUCTOR`: freezing, oneDNN's packed products) against the autotuned options they replaced
  (`AUTOTUNED`: inductor's C++ GEMM template timed against ATEN's product for each weight),
  the eager packed forward beside them: one token and 9 after 200 cached, bfloat16.
- `guards`: the default target's compiled forward as `compile_forward` makes it (a code
  object of its own, no guards on the model's modules: workers/compiled._compile) against
  torch.compile of the shared Llama.forward with every guard (the code before): one token and
  9 after 200 cached, bfloat16.

Both paths are warmed before the timed rounds; medians and their ratio are printed. Compiles
(the default pair's, minutes) happen in the warm-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

import blockspec.workers.compiled as compiled
import blockspec.workers.llama as llama
from blockspec.loadtest.bench.engine import forward_ms, run_engine
from blockspec.loadtest.bench.forward import windowed
from blockspec.loadtest.prompts import prompt_ids
from blockspec.service.build import build_engine
from blockspec.workers.compiled import compile_forward
from blockspec.workers.models import DEFAULT_DRAFT, DEFAULT_TARGET, load_model
from blockspec.workers.target import TargetWorker


def proposal(args) -> None:
    TargetWorker.use_compiled = lambda self: None  # the target eager: the draft's phase alone
    engine, tokenizer = build_engine(
        str(DEFAULT_DRAFT), str(DEFAULT_TARGET), 1, dtype="bfloat16", compiled=True
    )
    prompts = prompt_ids(tokenizer, "humaneval", 4, 900)
    arms = {"a compiled forward a depth": None, "one compiled call": engine.draft.proposals}
    for calls in arms.values():  # warm-up: every compile
        engine.draft.proposals = calls
        run_engine(engine, prompts, "gbv", 2, 4, 1.0, 16)
    ms = {name: [] for name in arms}
    for r in range(args.rounds):
        for name, calls in arms.items():
            engine.draft.proposals = calls
            res = run_engine(engine, prompts, "gbv", 2, 4, 1.0, 32)
            ms[name].append(engine.times.draft / engine.steps * 1e3)
            print(f"round {r} {name}: draft {ms[name][-1]:.2f} ms a step, "
                  f"BE {res['block_efficiency']:.2f}", flush=True)  # fmt: skip
    report(ms, "draft ms a step")


def attention(args) -> None:
    joined = llama.tree_attention

    def four_products(q, k, v, seen):
        return joined(q, k, v, dataclasses.replace(seen, hidden=None))

    arms = {"four products": four_products, "joined keys": joined}
    model = load_model(str(DEFAULT_TARGET), args.dtype).build(
        packed=False if args.compiled else None
    )
    if args.compiled:
        model.forward = windowed(compile_forward(model))
    cells = [(1, 1, 200), (9, 1, 200)] + ([] if args.compiled else [(5, 8, 1000)])
    for fn in arms.values():  # warm-up: every compile
        llama.tree_attention = fn
        for new, batch, context in cells:
            forward_ms(model, new, context, repeats=1, batch=batch)
    ms: dict[tuple, dict[str, list[float]]] = {}
    for _ in range(args.rounds):
        for name, fn in arms.items():
            llama.tree_attention = fn
            for new, batch, context in cells:
                t = forward_ms(model, new, context, repeats=15 if batch == 1 else 9, batch=batch)
                ms.setdefault((new, batch, context), {}).setdefault(name, []).append(t)
    for (new, batch, context), by_arm in ms.items():
        print(f"{new} new tokens, batch {batch}, {context} cached:")
        report(by_arm, "forward ms")


# workers/compiled.INDUCTOR before oneDNN's packed products replaced the autotuned ones
AUTOTUNED = {
    "freezing": True,
    "cpp_wrapper": True,
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP,ATEN",
    "autotune_num_choices_displayed": 0,
    "max_autotune_report_choices_stats": False,
}


def gemm(args) -> None:
    loaded = load_model(str(DEFAULT_TARGET), "bfloat16")
    models = {"autotuned": AUTOTUNED, "packed oneDNN": compiled.INDUCTOR, "eager": None}
    for name, options in models.items():
        model = loaded.build(packed=None if options is None else False)
        if options is not None:  # _compiling reads INDUCTOR when the forward is made
            compiled.INDUCTOR = options
            model.forward = windowed(compile_forward(model))
        models[name] = model
    alternate_forwards(models, args.rounds)


def guards(args) -> None:
    loaded = load_model(str(DEFAULT_TARGET), "bfloat16")
    every_guard, own_code = loaded.build(packed=False), loaded.build(packed=False)
    shared = torch.compile(compiled.traced_forward(every_guard), dynamic=True)
    every_guard.forward = windowed(compiled._compiling(shared, torch.device("cpu")))
    own_code.forward = windowed(compile_forward(own_code))
    models = {"every guard": every_guard, "own code, no module guards": own_code}
    alternate_forwards(models, args.rounds)


def alternate_forwards(models: dict, rounds: int) -> None:
    """Each model's forward of one token and of 9 after 200 cached, warmed, then alternated."""
    for model in models.values():  # warm-up: every compile
        for new in (1, 9):
            forward_ms(model, new, 200, repeats=1)
    ms: dict[int, dict[str, list[float]]] = {1: {}, 9: {}}
    for _ in range(rounds):
        for name, model in models.items():
            for new in ms:
                ms[new].setdefault(name, []).append(forward_ms(model, new, 200, repeats=15))
    for new, by_arm in ms.items():
        print(f"{new} new tokens, 200 cached:")
        report(by_arm, "forward ms")


def report(ms: dict[str, list[float]], unit: str) -> None:
    medians = {name: statistics.median(v) for name, v in ms.items()}
    for name, m in medians.items():
        print(f"  {name}: {unit} median {m:.2f}")
    before, after = list(medians.values())[:2]
    print(f"  ratio (first / second): {before / after:.2f}x", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("change", choices=["proposal", "attention", "gemm", "guards"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", help="attention: the target's dtype")
    ap.add_argument("--compiled", action="store_true", help="attention: compiled forwards")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    modes = {"proposal": proposal, "attention": attention, "gemm": gemm, "guards": guards}
    modes[args.change](args)


if __name__ == "__main__":
    main()
