"""Side-by-side benchmark of the speculative engine on a model pair (one run, one machine).

    blockspec-bench engine [--prompts 50] [--new-tokens 128] \\
        [--methods ...] [--k 1 2 3 4] [--gamma 4 8] [--temperature 0.6 1.0] [--batch 1 8] \\
        [--threads 1] [--json docs/benchmarks.json]

Method `auto` (service/policy.py) is one row per T and batch size, its own K and γ; a method
named twice runs twice, e.g. `--methods block auto block auto` to alternate them.

For every method × K × γ × T × batch size it generates `--new-tokens` tokens for each of the
first `--prompts` HumanEval prompts (continuous batching at the given batch size; stop tokens
off so every request produces the same number of tokens) and reports block efficiency
(emitted tokens per target call), tokens/s, and the step-time breakdown (draft / tree /
target / verify / overhead, summed over steps, as a share of the run). Baselines in the same
run: method `none` (plain target decoding through the same engine) and Hugging Face assisted
generation (`generate(assistant_model=draft, do_sample=True)`, token verification, batch 1).
Also prints the measured draft/target cost ratio c and the ideal speedup BE / (1 + γ c).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from blockspec.loadtest.bench.harness import command, machine, median_ms, parser, save_json
from blockspec.loadtest.prompts import prompt_ids
from blockspec.service.build import build_engine
from blockspec.service.policy import AUTO
from blockspec.service.requests import make_request
from blockspec.verification import VERIFIERS
from blockspec.workers.draft import prefill
from blockspec.workers.llama import KVCache, Llama
from blockspec.workers.models import DEFAULT_DRAFT, DEFAULT_TARGET, FEATURE_FC, TOKEN_ONLY_DRAFT
from blockspec.workers.sampling import SamplingParams


def forward_call(model: Llama, new: int = 1, context: int = 200, batch: int = 1):
    """A forward of `new` tokens per request (a causal chain, as in a γ-token tree pass) for
    `batch` requests, each after a KV cache of `context` tokens, as a callable."""
    dtype, E = model.embed.dtype, model.spec.hidden_size
    cache = KVCache(model.spec, model.kv_heads, batch, context + new + 2, dtype, "cpu")
    reads = model.feature_fc is not None  # a feature draft: zero features cost the same
    ctx = [torch.zeros(context, E)] * batch if reads else None
    contexts = [torch.randint(0, model.spec.vocab_size, (context,)) for _ in range(batch)]
    prefill(model, cache, 0, contexts, features=ctx)
    tok = torch.zeros(batch, 1, new, dtype=torch.int64)
    pos = (context + torch.arange(new)).view(1, 1, new).expand(batch, 1, new)
    mask = torch.ones(new, new, dtype=torch.bool).tril().expand(batch, 1, new, new)
    features = torch.zeros(batch, 1, new, E) if reads else None
    return lambda: model(tok, pos, cache, mask, features=features)


def forward_ms(
    model: Llama, new: int = 1, context: int = 200, repeats: int = 30, batch: int = 1
) -> float:
    """Median ms of `forward_call`'s forward."""
    return median_ms(forward_call(model, new, context, batch), repeats, warm=0)


def run_engine(engine, prompts, method, k, gamma, temperature, new_tokens, seed=0):
    sampling = SamplingParams(temperature)
    reqs = [
        make_request(engine.limits, p, new_tokens, method, k, gamma, sampling, seed=seed + i)
        for i, p in enumerate(prompts)
    ]
    engine.reset_stats()
    start = time.perf_counter()
    results = engine.generate(reqs)
    wall = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r in results)
    calls = sum(r.stats.target_calls for r in results)
    t = engine.times
    phases = {p: getattr(t, p) for p in ("draft", "tree", "target", "verify", "overhead")}
    return dict(
        tokens=tokens,
        target_calls=calls,
        block_efficiency=tokens / calls,
        tokens_per_s=tokens / wall,
        wall_s=wall,
        mean_batch=t.batch_size / max(engine.steps, 1),
        phase_share={p: v / max(sum(phases.values()), 1e-12) for p, v in phases.items()},
    )


def run_hf_assisted(draft_dir, target_dir, prompts, temperature, new_tokens, dtype):
    from transformers import AutoModelForCausalLM

    from blockspec.workers.models import DTYPES

    def load(path):
        return AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=DTYPES[dtype]
        ).eval()

    target, draft = load(target_dir), load(draft_dir)
    tokens, start = 0, time.perf_counter()
    torch.manual_seed(0)
    for p in prompts:
        out = target.generate(
            torch.tensor([p]),
            assistant_model=draft,
            do_sample=True,
            temperature=temperature,
            top_k=0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
        tokens += out.shape[1] - len(p)
    wall = time.perf_counter() - start
    return dict(tokens=tokens, tokens_per_s=tokens / wall, wall_s=wall)


def options(argv: list[str] | None):
    ap = parser("engine", __doc__)
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--target", default=str(DEFAULT_TARGET))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--methods", nargs="+", default=list(VERIFIERS))
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--gamma", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.6, 1.0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-hf", action="store_true", help="skip the HF assisted-generation baseline")
    ap.add_argument(
        "--hf-draft",
        help="the draft HF assisted generation uses (default: --draft; for the default feature "
        "draft, the default pair's token-only draft: HF cannot give a draft the target's features)",
    )
    ap.add_argument(
        "--json", default="docs/benchmarks.json", help="the raw result (docs/benchmarks.md's)"
    )
    args = ap.parse_args(argv)
    given, args.hf_draft = args.hf_draft, args.hf_draft or args.draft
    if not args.no_hf and (Path(args.hf_draft) / FEATURE_FC).exists():
        if given or Path(args.draft) != DEFAULT_DRAFT:
            ap.error(
                f"{args.hf_draft} is a feature draft, which HF cannot run: pass --hf-draft or "
                "--no-hf"
            )
        args.hf_draft = str(TOKEN_ONLY_DRAFT)  # the default pair's own token-only draft
    return args


def configurations(args) -> list[tuple[str, int, int]]:
    """(method, K, γ) after the baseline `none`; `auto` picks K and γ itself (0, 0)."""
    out = []
    for method in (m for m in args.methods if m != "none"):
        if method == AUTO:
            out.append((AUTO, 0, 0))
            continue
        ks = [1] if VERIFIERS[method].single_path else args.k
        out += [(method, k, gamma) for k in ks for gamma in args.gamma]
    return out


def main(argv: list[str] | None = None) -> None:
    args = options(argv)
    torch.set_num_threads(args.threads)
    built = {b: build_engine(args.draft, args.target, b, dtype=args.dtype) for b in args.batch}
    engines = {b: engine for b, (engine, _) in built.items()}
    some_engine, tokenizer = built[args.batch[0]]
    # Keep each prompt's last tokens so that prompt + new tokens + a draft block fit the models'
    # context (the bundled pair was trained on 384 positions; some HumanEval prompts are longer).
    room = some_engine.max_len - args.new_tokens - max(args.gamma) - 2
    prompts = prompt_ids(tokenizer, "humaneval", args.prompts, room)
    # Warm-up, discarded: the first steps of a process pay for allocator growth and lazy
    # initialisation, which would otherwise land on whichever configuration runs first.
    for engine in engines.values():
        for method in ("none", args.methods[0]):
            run_engine(engine, prompts[: engine.max_batch], method, 1, args.gamma[0], 1.0, 16)
    target_ms = forward_ms(some_engine.target.model)
    c = forward_ms(some_engine.draft.model) / target_ms
    tree_cost = {g: forward_ms(some_engine.target.model, g + 1) / target_ms for g in args.gamma}
    print(f"draft/target forward cost ratio c = {c:.3f} (batch 1, one token, 200-token cache)")
    print(
        f"target forward, batch 1: {target_ms:.1f} ms for one token; γ+1 tokens cost "
        + ", ".join(f"{v:.2f}× (γ = {g})" for g, v in tree_cost.items())
        + "\n"
    )
    print(
        "| method | K | γ | T | batch | BE | tok/s | × none | ideal BE/(1+γc) "
        "| draft | tree | target | verify | overhead |"
    )
    print("|" + "---|" * 14, flush=True)
    result: dict = dict(c=c, target_ms=target_ms, tree_cost=tree_cost, dtype=args.dtype,
                        prompts=args.prompts, new_tokens=args.new_tokens, rows=[])  # fmt: skip
    for temperature in args.temperature:
        for batch in args.batch:
            engine = engines[batch]
            base = run_engine(engine, prompts, "none", 1, 1, temperature, args.new_tokens)
            runs = [(dict(method="none", k=1, gamma=0), base)]
            for method, k, gamma in configurations(args):
                run = (method, max(k, 1), max(gamma, 1))  # auto's row says 0, 0: its own choice
                res = run_engine(engine, prompts, *run, temperature, args.new_tokens)
                runs.append((dict(method=method, k=k, gamma=gamma), res))
            if not args.no_hf and batch == 1:
                hf = run_hf_assisted(
                    args.hf_draft, args.target, prompts, temperature, args.new_tokens, args.dtype
                )
                runs.append((dict(method="hf_assisted", k=1, gamma=0), hf))
            for cfg, res in runs:
                result["rows"].append(dict(cfg, temperature=temperature, batch=batch, **res))
                print(_row(result["rows"][-1], base, c), flush=True)
            # after every batch size, so an interrupted multi-hour run keeps what it measured
            save_json(args.json, "engine", argv, result)
    print(f"\nCommand: `{command('engine', argv)}`; {machine()}")


def _row(r: dict, base: dict, c: float) -> str:
    speedup = r["tokens_per_s"] / base["tokens_per_s"]
    if r["method"] == "hf_assisted":
        return (f"| hf_assisted | 1 | - | {r['temperature']} | 1 | - | {r['tokens_per_s']:.1f} "
                f"| {speedup:.2f} | - | | | | | |")  # fmt: skip
    share = r["phase_share"]
    ideal = r["block_efficiency"] / (1 + r["gamma"] * c)
    return (
        f"| {r['method']} | {r['k']} | {r['gamma']} | {r['temperature']} | {r['batch']} | "
        f"{r['block_efficiency']:.2f} | {r['tokens_per_s']:.1f} | "
        f"{speedup:.2f} | {ideal:.2f} | "
        + " | ".join(
            f"{100 * share[p]:.0f}%" for p in ("draft", "tree", "target", "verify", "overhead")
        )
        + " |"
    )
