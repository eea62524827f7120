"""Held-out evaluation of the default pair's draft, per kind of request.

Prompts: the 70 everyday conversations of `loadtest.everyday` (10 kinds, never trained on) and
the first `--humaneval` HumanEval problems ("humaneval"), all in the chat template. For each:

* α per kind at each temperature: the target answers every prompt (plain decoding, fp32,
  seeded, stopping at its end-of-turn token); teacher-forced on those answers,
  α = mean over answer positions of Σ_x min(p_T, q_T), the served draft reading the target's
  features (the tree's first level);
* block efficiency (BE: emitted tokens per target call) per kind: the in-process engine on the
  same prompts for every method × γ × temperature (`token` and `block` with K = 1, `gbv` with
  K = `--gbv-k`), batches of `--batch`, seeded, stopping at end-of-turn;
* the draft's cost c: its one-token forward over the target's, batch 1 (median of 30).

`--compare DIR` measures a second draft side by side (α at every temperature, and BE of `block`
γ = 4 at T = 1 only: the goal's configuration). Example (the model card's table):

    python -m blockspec.models.eval_draft --compare /tmp/old-draft --json docs/draft_eval.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from blockspec.loadtest.bench.engine import forward_ms
from blockspec.loadtest.everyday import everyday_ids
from blockspec.loadtest.prompts import prompt_ids
from blockspec.models.train_draft import shifted
from blockspec.service.build import build_engine
from blockspec.service.requests import make_request
from blockspec.workers.llama import KVCache
from blockspec.workers.models import DEFAULT_DRAFT, DEFAULT_TARGET, load_model
from blockspec.workers.sampling import SamplingParams

MAX_LEN = 1024


def prompts_by_kind(tokenizer, humaneval: int, new_tokens: int, per_kind: int | None):
    """[(kind, prompt ids)]: the everyday conversations (`per_kind` of each), then HumanEval."""
    room = MAX_LEN - new_tokens - 8
    code = prompt_ids(tokenizer, "humaneval", humaneval, room) if humaneval else []
    return everyday_ids(tokenizer, room, per_kind) + [("humaneval", p) for p in code]


def answer_logits(model, prompt: list[int], answer: list[int], target_hidden=None):
    """Teacher-forced: the model's logits at the positions that predict the answer [A, V], and
    its final-norm hidden states [1, 1, T, E]. A feature draft reads `target_hidden` (the
    target's, from the same call) one position back."""
    seq, T = torch.tensor(prompt + answer), len(prompt) + len(answer)
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    cache = KVCache(model.spec, model.kv_heads, 1, T, model.embed.dtype, "cpu")
    back = shifted(target_hidden) if model.feature_fc is not None else None
    logits, _, _, hidden = model(
        seq[None, None], torch.arange(T)[None, None], cache, mask, features=back
    )
    return logits[0, 0, len(prompt) - 1 : T - 1], hidden


def run(engine, prompts, method, k, gamma, temp, new_tokens, eos, seed=0):
    """Per prompt (emitted tokens, target calls, tokens); the request's seed is `seed` × 100,003
    + the prompt's index (seed 0: the model card's runs)."""
    reqs = [
        make_request(
            engine.limits,
            p,
            new_tokens,
            method,
            k,
            gamma,
            SamplingParams(temp),
            seed * 100_003 + i,
            (eos,),
        )
        for i, (_, p) in enumerate(prompts)
    ]
    return [(len(r.token_ids), r.stats.target_calls, r.token_ids) for r in engine.generate(reqs)]


def per_kind(prompts, values) -> dict[str, list]:
    groups = defaultdict(list)
    for (kind, _), v in zip(prompts, values, strict=True):
        groups[kind].append(v)
    return groups


def block_efficiency(prompts, results) -> dict[str, float]:
    """Emitted tokens per target call, per kind, over the everyday kinds ("everyday"), and over
    everything ("all")."""
    groups = per_kind(prompts, [(n, c) for n, c, _ in results])
    groups["everyday"] = [v for k, vs in groups.items() if k != "humaneval" for v in vs]
    groups["all"] = [(n, c) for n, c, _ in results]
    return {k: sum(n for n, _ in v) / max(sum(c for _, c in v), 1) for k, v in groups.items()}


@torch.no_grad()
def alphas(draft, target, prompts, answers, temp) -> dict[str, float]:
    """Teacher-forced α per kind (and "everyday", "all") on the target's answers at `temp`."""
    rows = []
    for (_, prompt), answer in zip(prompts, answers, strict=True):
        if not answer:
            rows.append(torch.zeros(0))
            continue
        p_logits, hidden = answer_logits(target, prompt, list(answer))
        q_logits, _ = answer_logits(draft, prompt, list(answer), hidden)
        p, q = (p_logits / temp).softmax(-1), (q_logits / temp).softmax(-1)
        rows.append(torch.minimum(p, q).sum(-1).double())  # [answer]
    groups = per_kind(prompts, rows)
    groups["everyday"] = [r for k, rs in groups.items() if k != "humaneval" for r in rs]
    groups["all"] = rows
    return {k: float(torch.cat(v).mean()) for k, v in groups.items()}


def report(result: dict) -> str:
    """The model card's tables (markdown) from a result."""
    alpha, be = result["alpha"], result["block_efficiency"]
    kinds = [*list(result["prompts"]), "everyday", "all"]
    temps = sorted({k.split("T=")[1] for k in alpha}, reverse=True)
    goal = "block K=1 gamma=4 T=1.0"  # the configuration, when the grid has it
    columns = {f"α T={t}": (alpha, f"T={t}", "{:.3f}") for t in temps}
    if f"draft {goal}" in be:
        columns["BE block γ=4 T=1"] = (be, goal, "{:.2f}")
    head = ["kind", "prompts", *columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for kind in kinds:
        n = result["prompts"].get(kind, sum(result["prompts"].values()))
        if kind == "everyday":
            n -= result["prompts"].get("humaneval", 0)
        cells = [kind, str(n)]
        for table, key, fmt in columns.values():  # the compared draft's value in parentheses
            old = table.get(f"compare {key}", {}).get(kind)
            cells.append(fmt.format(table[f"draft {key}"][kind]))
            cells[-1] += "" if old is None else " (" + fmt.format(old) + ")"
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| method | K | γ | T | " + " | ".join(kinds) + " |"]
    lines.append("|" + "---|" * (4 + len(kinds)))
    for key, row in be.items():
        if not key.startswith("draft "):
            continue
        method, k, gamma, temp = key.split()[1:]
        cells = [method, k[2:], gamma[6:], temp[2:]] + [f"{row[kind]:.2f}" for kind in kinds]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--target", default=str(DEFAULT_TARGET))
    ap.add_argument("--compare", help="a second draft: α, and block γ = 4 at T = 1")
    ap.add_argument("--methods", nargs="+", default=["token", "block", "gbv"])
    ap.add_argument("--gbv-k", type=int, default=2)
    ap.add_argument("--gamma", type=int, nargs="+", default=[3, 4, 6])
    ap.add_argument("--temperature", type=float, nargs="+", default=[1.0, 0.7])
    ap.add_argument("--humaneval", type=int, default=40)
    ap.add_argument("--per-kind", type=int, help="at most this many per kind (default: all)")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--seed",
        type=int,
        default=0,
        help="requests' seeds: another value draws other sample paths (a seeded BE is one path)",
    )
    ap.add_argument("--json", type=Path)
    ap.add_argument("--report", type=Path, help="print the tables of an earlier --json, and exit")
    args = ap.parse_args()
    if args.report:
        print(report(json.loads(args.report.read_text())))
        return
    torch.set_num_threads(args.threads)
    started = time.time()

    drafts = {"draft": args.draft} | ({"compare": args.compare} if args.compare else {})
    engines = {}
    for name, path in drafts.items():
        engines[name], tok = build_engine(path, args.target, args.batch, MAX_LEN)
    eos = tok.eos_token_id
    prompts = prompts_by_kind(tok, args.humaneval, args.new_tokens, args.per_kind)
    target = load_model(args.target, "float32").build()
    teachers = {name: load_model(path, "float32").build() for name, path in drafts.items()}
    engine = engines["draft"]
    cost = {
        name: forward_ms(e.draft.model) / forward_ms(e.target.model) for name, e in engines.items()
    }
    result = dict(
        prompts={k: len(v) for k, v in per_kind(prompts, prompts).items()},
        new_tokens=args.new_tokens,
        batch=args.batch,
        seed=args.seed,
        draft_cost=cost,
        alpha={},
        block_efficiency={},
    )
    for temp in args.temperature:
        answers = [
            t
            for _, _, t in run(engine, prompts, "none", 1, 1, temp, args.new_tokens, eos, args.seed)
        ]
        for name, draft in teachers.items():
            result["alpha"][f"{name} T={temp}"] = alphas(draft, target, prompts, answers, temp)
            print(name, temp, "alpha", result["alpha"][f"{name} T={temp}"], flush=True)
    configs = [
        ("draft", m, args.gbv_k if m == "gbv" else 1, g, t)
        for t in args.temperature
        for m in args.methods
        for g in args.gamma
    ]
    if args.compare:
        configs.insert(0, ("compare", "block", 1, 4, 1.0))
    for name, method, k, gamma, temp in configs:
        key = f"{name} {method} K={k} gamma={gamma} T={temp}"
        res = run(engines[name], prompts, method, k, gamma, temp, args.new_tokens, eos, args.seed)
        result["block_efficiency"][key] = block_efficiency(prompts, res)
        print(key, {k: round(v, 2) for k, v in result["block_efficiency"][key].items()}, flush=True)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")
    result["machine"] = f"{platform.processor() or platform.machine()}, torch {torch.__version__}"
    result["minutes"] = round((time.time() - started) / 60, 1)
    result["command"] = " ".join(["python -m blockspec.models.eval_draft", *sys.argv[1:]])
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
